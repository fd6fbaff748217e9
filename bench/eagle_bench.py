"""EAGLE head vs autoregressive decoding vs HF assisted generation (NF4 self-draft), embedded target, greedy.

    PYTHONPATH=. .venv/bin/python bench/eagle_bench.py [--head embedded|DIR ...] [--k 4] [--new-tokens 128]
        [--repeats 3] [--head-precision bf16] [--out bench/results]

``--head`` may be given several times (e.g. the shipped EAGLE-1 head and an EAGLE-3 head in the speculators
layout): every head is timed in the same interleaved run, one row each.

Prompts: the ``short`` suite (``recipes/prompts/short.yaml``) and ``UNSEEN`` below (written for this benchmark, used
by no training run). Timing is :func:`toolkit.measure.harness.measure` per suite: one warm-up call per method, then
``--repeats`` repetitions over the suite's prompts, the methods back to back per prompt (interleaved) and their
order rotated between repetitions, the same ``max_new_tokens`` (EOS ignored): ``ar`` (HF ``generate``), ``ar_loop``
(our decode loop with no drafter), ``assisted`` (HF assisted generation, NF4 copy of the target as assistant,
constant K), ``eagle[HEAD]`` (our loop with the EAGLE drafter of each head, constant K). Every method's tokens are
checked against ``ar`` (token-identical). Reported per suite: throughput (new tokens / wall time of a repetition;
median and min-max over repetitions), speedup ratios against ``ar`` and ``assisted`` (within each repetition, median
over repetitions), acceptance rate alpha, tokens per round tau, and per-position acceptance of the EAGLE drafts. Writes
``OUT/eagle_bench.json`` and ``OUT/eagle_bench.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.dtypes import torch_dtype  # noqa: E402
from toolkit.eagle.checkpoint import load_head, resolve_head  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.baselines import hf_generate  # noqa: E402
from toolkit.measure.harness import Call, Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec  # noqa: E402
from toolkit.engine.planner import ConstantK  # noqa: E402
from toolkit.engine.decoder import SpeculativeDecoder  # noqa: E402
from toolkit.speculative.drafters.eagle import EagleDrafter  # noqa: E402
from toolkit.speculative.stats import GenerationStats, acceptance_summary  # noqa: E402

UNSEEN = [
    "Describe how a refrigerator keeps food cold, in one paragraph.",
    "Write a short email asking a colleague to review my report by Friday.",
    "What are the main causes of traffic congestion in large cities?",
    "Explain the rules of chess to a beginner in a few sentences.",
    "List four advantages of learning to play a musical instrument.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
]


def encode(tokenizer, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        return tokenizer(prompt, return_tensors="pt").input_ids
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def ours(target, drafter, ids, gen, k) -> tuple[list[int], GenerationStats]:
    """Our decode loop with ``drafter`` (``None``: plain AR through our loop) at constant K."""
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(k))
    out = [t for chunk in decoder.decode(ids, gen, stats) for t in chunk]
    return out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", action="append", help="head directory or 'embedded' (repeatable; default embedded)")
    parser.add_argument("--head-precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--target-precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--assist-k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suites", default="short,unseen")
    parser.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each suite (smoke runs)")
    parser.add_argument("--no-assisted", action="store_true", help="skip HF assisted generation")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)

    target, tokenizer = load_model(ModelSpec(source="embedded", precision=args.target_precision, device="cpu"))
    sources = args.head or ["embedded"]
    names = [h if h == "embedded" else Path(h).name for h in sources]
    labels = [n if names.count(n) == 1 else f"{i}:{n}" for i, n in enumerate(names)]  # unique row labels
    heads = {label: load_head(resolve_head(h), target, dtype=torch_dtype(args.head_precision))
             for label, h in zip(labels, sources)}
    assistant = None
    if not args.no_assisted:
        assistant, _ = load_model(ModelSpec(source="embedded", precision="int4", device="cpu"), "draft")
    gen = GenerationSpec(max_new_tokens=args.new_tokens, ignore_eos=True)
    suites = {}
    for name in args.suites.split(","):
        if name == "unseen":
            suites[name] = [(f"unseen-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(UNSEEN)]
        else:
            suites[name] = [(p.id, p.prompt) for p in load_suite(name)]

    if args.max_prompts:
        suites = {name: prompts[:args.max_prompts] for name, prompts in suites.items()}
    def call(fn):
        return lambda ids, g: Call(*fn(ids, g))

    runners = {
        "ar": call(lambda ids, g: hf_generate(target, ids, g, [], method="ar")),
        "ar_loop": call(lambda ids, g: ours(target, None, ids, g, 1)),
    }
    for label, head in heads.items():
        runners[f"eagle[{label}]"] = call(lambda ids, g, head=head: ours(target, EagleDrafter(target, head), ids, g,
                                                                        args.k))
    eagles = [name for name in runners if name.startswith("eagle[")]
    if assistant is not None:
        runners["assisted"] = call(lambda ids, g: hf_generate(target, ids, g, [], method="assisted",
                                                              assistant_model=assistant,
                                                              num_draft_tokens=args.assist_k))
    results = {"config": vars(args) | {"out": str(args.out)}, "environment": environment(), "suites": {}}
    for suite, prompts in suites.items():
        encoded = [Prompt(pid, suite, encode(tokenizer, prompt)) for pid, prompt in prompts]
        m = measure(runners, encoded, gen, repeats=args.repeats, warmup=1, rotate=True, desc=suite)
        reference = [c.token_ids for c in m.first("ar")]
        identical = {name: all([c.token_ids for c in rep] == reference for rep in m.calls[name]) for name in runners}
        acceptance = {e: acceptance_summary([c.stats for rep in m.calls[e] for c in rep]) for e in eagles}
        results["suites"][suite] = {
            "prompts": [p.id for p in encoded], "speed": {name: m.speed(name) for name in runners},
            "median_throughput": {name: m.speed(name)["throughput"]["median"] for name in runners},
            "eagle_alpha": {e: a["acceptance_rate"] for e, a in acceptance.items()},
            "eagle_tau": {e: a["tokens_per_round"] for e, a in acceptance.items()},
            "eagle_curve": {e: a["curve"] for e, a in acceptance.items()},
            "ratios": {e: {f"vs_{name}": m.paired_ratio(e, name) for name in runners if not name.startswith("eagle[")}
                       for e in eagles},
            "identical": identical, "all_identical": all(identical.values())}
        print(f"[{suite}] " + ", ".join(f"{name} {v:.1f} tok/s" for name, v in
                                         results["suites"][suite]["median_throughput"].items())
              + f", tau {results['suites'][suite]['eagle_tau']}, identical {identical}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "eagle_bench.json", results)
    lines = ["# EAGLE head benchmark (embedded SmolLM2-135M-Instruct, CPU, greedy)", "",
             f"target {args.target_precision}, heads {', '.join(heads)} ({args.head_precision}), K = {args.k}, "
             f"assisted K = {args.assist_k} (NF4 self-draft), {args.new_tokens} new tokens, EOS ignored, median of "
             f"{args.repeats} interleaved repetitions after a warm-up, torch threads {torch.get_num_threads()}.", "",
             "| suite | head | AR tok/s | assisted tok/s | EAGLE tok/s | EAGLE vs AR | EAGLE vs assisted | alpha | "
             "tau | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for suite, res in results["suites"].items():
        m = res["median_throughput"]
        for e in eagles:
            r = res["ratios"][e]
            lines.append(f"| {suite} | {e[6:-1]} | {m['ar']:.1f} | {m.get('assisted', float('nan')):.1f} | "
                         f"{m[e]:.1f} | {r['vs_ar']:.2f}x | {r.get('vs_assisted', float('nan')):.2f}x | "
                         f"{res['eagle_alpha'][e]:.3f} | {res['eagle_tau'][e]:.2f} | {res['identical'][e]} |")
    atomic_write_text(args.out / "eagle_bench.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
