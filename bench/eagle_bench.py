"""EAGLE head vs autoregressive decoding vs HF assisted generation (NF4 self-draft), embedded target, greedy.

    PYTHONPATH=. .venv/bin/python bench/eagle_bench.py [--head embedded|DIR] [--k 4] [--new-tokens 128]
        [--repeats 3] [--head-precision bf16] [--out bench/results]

Prompts: the ``short`` suite (``recipes/prompts/short.yaml``) and ``UNSEEN`` below (written for this benchmark, used
by no training run). For each prompt, after one warm-up of every method, the methods run in rotation ``--repeats``
times with the same ``max_new_tokens`` (EOS ignored): ``ar`` (HF ``generate``), ``ar_loop`` (our decode loop with
no drafter), ``assisted`` (HF assisted generation, NF4 copy of the target as assistant, constant K), ``eagle``
(our loop with the EAGLE drafter, constant K). Every method's tokens are checked against ``ar`` (token-identical).
Reported per suite: throughput (new tokens / total wall time) median over repeats and prompts, speedup ratios
against ``ar`` and ``assisted`` measured in the same process, acceptance rate alpha, tokens per round tau, and
per-position acceptance of the EAGLE drafts. Writes ``OUT/eagle_bench.json`` and ``OUT/eagle_bench.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.baselines import hf_generate  # noqa: E402
from toolkit.eagle.checkpoint import load_head, resolve_head  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.models.loading import _DTYPES  # noqa: E402
from toolkit.prompts import load_suite  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec  # noqa: E402
from toolkit.speculative.adaptive import ConstantK  # noqa: E402
from toolkit.speculative.decoder import SpeculativeDecoder  # noqa: E402
from toolkit.speculative.drafters.eagle import EagleDrafter  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402

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


def ours(target, drafter, ids, gen, k):
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, ConstantK(k))
    out = [t for chunk in decoder.decode(ids, gen, stats) for t in chunk]
    return out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="embedded")
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
    head = load_head(resolve_head(args.head), target, dtype=_DTYPES[args.head_precision])
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
    methods = {
        "ar": lambda ids: hf_generate(target, ids, gen, [], method="ar"),
        "ar_loop": lambda ids: ours(target, None, ids, gen, 1),
        "eagle": lambda ids: ours(target, EagleDrafter(target, head), ids, gen, args.k),
    }
    if assistant is not None:
        methods["assisted"] = lambda ids: hf_generate(target, ids, gen, [], method="assisted",
                                                      assistant_model=assistant, num_draft_tokens=args.assist_k)
    results = {"config": vars(args) | {"out": str(args.out)}, "torch_threads": torch.get_num_threads(),
               "suites": {}}
    for suite, prompts in suites.items():
        rows = []
        for pid, prompt in prompts:
            ids = encode(tokenizer, prompt)
            reference, _ = methods["ar"](ids)  # warm-up of ar, and the reference tokens
            for name, fn in methods.items():
                if name != "ar":
                    fn(ids)  # warm-up
            runs = {name: [] for name in methods}
            identical = {name: True for name in methods}
            for _ in range(args.repeats):
                for name, fn in methods.items():
                    out, stats = fn(ids)
                    identical[name] &= out == reference
                    runs[name].append(stats)
            row = {"id": pid, "prompt_tokens": int(ids.shape[1]), "identical": identical}
            for name, stats_list in runs.items():
                tput = [s.new_tokens / (s.total_ms / 1000) for s in stats_list]
                row[name] = {"throughput": statistics.median(tput), "min": min(tput), "max": max(tput)}
                if name == "eagle":
                    s = stats_list[0]
                    row[name] |= {"alpha": s.acceptance_rate, "tau": s.tokens_per_round,
                                  "accepted": s.accepted, "drafted": s.drafted, "rounds": s.rounds}
            rows.append(row)
            print(f"[{suite}] {pid}: " + ", ".join(f"{m} {row[m]['throughput']:.1f} tok/s" for m in methods)
                  + f", eagle tau {row['eagle']['tau']:.2f}, identical {identical}", flush=True)
        summary = {}
        for name in methods:
            summary[name] = statistics.median(r[name]["throughput"] for r in rows)
        eagle_alpha = sum(r["eagle"]["accepted"] for r in rows) / max(1, sum(r["eagle"]["drafted"] for r in rows))
        tau = statistics.mean(r["eagle"]["tau"] for r in rows)
        ratios = {f"eagle_vs_{m}": statistics.median(r["eagle"]["throughput"] / r[m]["throughput"] for r in rows)
                  for m in methods if m != "eagle"}
        results["suites"][suite] = {"rows": rows, "median_throughput": summary, "eagle_alpha": eagle_alpha,
                                    "eagle_tau": tau, "ratios": ratios,
                                    "all_identical": all(all(r["identical"].values()) for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "eagle_bench.json", results)
    lines = ["# EAGLE head benchmark (embedded SmolLM2-135M-Instruct, CPU, greedy)", "",
             f"target {args.target_precision}, head {args.head} ({args.head_precision}), K = {args.k}, assisted K = "
             f"{args.assist_k} (NF4 self-draft), {args.new_tokens} new tokens, EOS ignored, median of {args.repeats} "
             f"runs per prompt after a warm-up, torch threads {torch.get_num_threads()}.", "",
             "| suite | AR tok/s | assisted tok/s | EAGLE tok/s | EAGLE vs AR | EAGLE vs assisted | alpha | tau | "
             "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for suite, res in results["suites"].items():
        m, r = res["median_throughput"], res["ratios"]
        lines.append(f"| {suite} | {m['ar']:.1f} | {m.get('assisted', float('nan')):.1f} | {m['eagle']:.1f} | "
                     f"{r['eagle_vs_ar']:.2f}x | {r.get('eagle_vs_assisted', float('nan')):.2f}x | "
                     f"{res['eagle_alpha']:.3f} | {res['eagle_tau']:.2f} | {res['all_identical']} |")
    atomic_write_text(args.out / "eagle_bench.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
