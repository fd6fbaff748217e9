"""Tree speculation and the suffix drafter on the embedded model (CPU), every method in one process.

    PYTHONPATH=. .venv/bin/python bench/tree_bench.py [--precisions bf16 fp32] [--repeats 3] [--new-tokens 128]
        [--suites short repeat] [--draft-model] [--prompts N]

For each target precision and prompt suite (``recipes/prompts/short.yaml``; ``repeat.yaml``: every request asked,
then asked again with a small edit), greedy, the same prompts and ``max_new_tokens`` for every method:

* ``hf-ar`` — HF ``generate`` (the AR reference for identical output and ratios);
* ``hf-prompt-lookup`` — HF prompt lookup decoding, K = 4, max n-gram 3 (as ``recipes/short-ngram.yaml``);
* ``ngram`` — our prompt-lookup drafter, linear, K = 4;
* ``suffix-linear`` — the suffix drafter's most probable chain, K = ``SUFFIX_K``;
* ``suffix-tree`` — the suffix drafter's frequency tree (``tree_budget`` / ``tree_depth`` below);
* with ``--draft-model``: ``self-linear`` / ``self-tree`` — the target's own weights at NF4 as draft (K = 4; EAGLE-2
  dynamic tree) — slow on this CPU.

Timing is :func:`toolkit.measure.harness.measure`: one untimed warm-up call per method (16 tokens), then ``--repeats``
repetitions; in each, every prompt of the suite in order and, per prompt, the methods back to back (interleaved,
so load drift on a shared machine hits them alike), their order rotated between repetitions. Our methods get a
fresh SpeculativeLM before every repetition, so the suffix drafter's memory holds only the earlier requests of that
repetition, never an earlier repetition of the same prompt. Reported per method: throughput (new tokens / wall
time of a repetition; median and min-max over repetitions), tokens per round τ (committed / rounds; HF: new tokens
per target forward), and whether every output is token-identical to ``hf-ar``. Ratios (computed within each
repetition, then the median over repetitions): tree vs linear (same drafter), suffix vs ngram / HF prompt lookup /
AR.

Writes ``bench/results/tree_bench.json`` and ``bench/results/tree_bench.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toolkit  # noqa: E402
from eval.runners import ours_runner  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.baselines import hf_generate  # noqa: E402
from toolkit.measure.harness import Call, Measurement, Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec  # noqa: E402

SUFFIX_K = 16
SUFFIX = {"drafter": "suffix", "max_spec_factor": 2.0, "min_token_prob": 0.05, "max_cached_requests": 16}
TREE = {"tree_budget": 12, "tree_depth": 16, "tree_topk": 4}


def method_specs(draft_model: bool) -> dict[str, SpeculationSpec | str]:
    methods: dict[str, SpeculationSpec | str] = {
        "hf-ar": "ar",
        "hf-prompt-lookup": "prompt_lookup",
        "ngram": SpeculationSpec(drafter="ngram", num_draft_tokens=4, max_ngram=3, min_ngram=1),
        "suffix-linear": SpeculationSpec(num_draft_tokens=SUFFIX_K, **SUFFIX),
        "suffix-tree": SpeculationSpec(num_draft_tokens=SUFFIX_K, tree=True, **SUFFIX, **TREE),
    }
    if draft_model:
        methods["self-linear"] = SpeculationSpec(drafter="self", num_draft_tokens=4)
        methods["self-tree"] = SpeculationSpec(drafter="self", num_draft_tokens=4, tree=True, tree_budget=16,
                                        tree_depth=5, tree_topk=4)
    return methods


def make_generator(method: str, spec, target, tokenizer, draft, gen: GenerationSpec):
    """A fresh SpeculativeLM for ``method`` (a fresh suffix memory); ``spec`` is a SpeculationSpec or an HF baseline
    name."""
    hf = isinstance(spec, str)
    recipe = Recipe(name=f"tree-bench-{method}", target=ModelSpec(source="embedded"),
                    draft=ModelSpec(source="embedded", precision="int4") if not hf and spec.config.uses_draft_model else None,
                    spec=SpeculationSpec(drafter="none") if hf else spec, generation=gen)
    return toolkit.build(recipe, target=target, tokenizer=tokenizer,
                         draft_model=draft if recipe.draft is not None else None)


def make_runners(methods: dict, target, tokenizer, draft, gen: GenerationSpec, eos_ids: list[int]):
    """``(runners, fresh)`` for :func:`toolkit.measure.harness.measure`: HF rows call ``hf_generate`` on the
    target; our rows run the decode loop of a SpeculativeLM that ``fresh(rep)`` rebuilds before every repetition (a
    fresh suffix memory: it holds only the earlier prompts of this repetition, never an earlier repetition of the
    same prompt)."""
    generators: dict = {}

    def fresh(_rep: int = 0) -> None:
        for m, spec in methods.items():
            if not isinstance(spec, str):
                generators[m] = make_generator(m, spec, target, tokenizer, draft, gen)

    fresh()

    def ours(method):
        return lambda ids, g: ours_runner(generators[method], eos_ids)(ids, g)

    def hf(spec):
        return lambda ids, g: Call(*hf_generate(target, ids, g, eos_ids, method=spec, num_draft_tokens=4,
                                                max_ngram=3))

    runners = {m: hf(spec) if isinstance(spec, str) else ours(m) for m, spec in methods.items()}
    return runners, fresh


RATIOS = {  # name: (method, baseline, key); computed within each repetition, then the median over repetitions
    "suffix_tree_vs_linear_throughput": ("suffix-tree", "suffix-linear", "throughput"),
    "suffix_tree_vs_linear_tau": ("suffix-tree", "suffix-linear", "tau"),
    "suffix_tree_vs_hf_prompt_lookup": ("suffix-tree", "hf-prompt-lookup", "throughput"),
    "suffix_tree_vs_ngram": ("suffix-tree", "ngram", "throughput"),
    "suffix_tree_vs_ar": ("suffix-tree", "hf-ar", "throughput"),
    "suffix_linear_vs_hf_prompt_lookup": ("suffix-linear", "hf-prompt-lookup", "throughput"),
    "suffix_linear_vs_ar": ("suffix-linear", "hf-ar", "throughput"),
    "ngram_vs_ar": ("ngram", "hf-ar", "throughput"),
    "hf_prompt_lookup_vs_ar": ("hf-prompt-lookup", "hf-ar", "throughput"),
    "self_tree_vs_linear_throughput": ("self-tree", "self-linear", "throughput"),
    "self_tree_vs_linear_tau": ("self-tree", "self-linear", "tau"),
}


def table(m: Measurement) -> dict:
    """Per method: throughput median / min / max (tok/s), τ, new tokens, and whether every repetition's output is
    token-identical to ``hf-ar``'s."""
    out = {}
    for method in m.methods:
        speed = m.speed(method)["throughput"]
        out[method] = {"throughput": speed["median"], "throughput_min": speed["min"],
                       "throughput_max": speed["max"], "tau": m.tau(method),
                       "tokens": sum(len(c.token_ids) for c in m.last(method)), "repeats": len(m.calls[method]),
                       "identical_to_ar": all([c.token_ids for c in rep] == [c.token_ids for c in m.first("hf-ar")]
                                              for rep in m.calls[method])}
    return out


def markdown(results: dict) -> str:
    lines = ["# Tree speculation and the suffix drafter (embedded SmolLM2-135M, CPU)", "",
             f"greedy, max_new_tokens={results['new_tokens']}, EOS {'ignored' if results['ignore_eos'] else 'kept'}, "
             f"{results['repeats']} timed repetitions per method (median, min-max); suffix K={SUFFIX_K}, tree {TREE}.", ""]
    for key, block in results["runs"].items():
        lines += [f"## {key}", "", "| method | throughput (tok/s) | min-max | τ (tokens/round) | vs hf-ar | "
                  "identical to AR |", "|---|---|---|---|---|---|"]
        ar = block["table"].get("hf-ar", {}).get("throughput")
        for method, row in block["table"].items():
            vs = f"{row['throughput'] / ar:.2f}×" if ar else "-"
            lines.append(f"| {method} | {row['throughput']:.1f} | {row['throughput_min']:.1f}–"
                         f"{row['throughput_max']:.1f} | {row['tau']:.2f} | {vs} | {row['identical_to_ar']} |")
        lines += ["", "| ratio (within a repetition, median over repetitions) | value |", "|---|---|"]
        for name, value in block["ratios"].items():
            lines.append(f"| {name} | {'-' if value is None else f'{value:.2f}×'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--suites", nargs="+", default=["short", "repeat"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--draft-model", action="store_true", help="also the NF4 self-draft, linear vs tree")
    parser.add_argument("--prompts", type=int, default=0, help="first N prompts of each suite (0 = all)")
    parser.add_argument("--methods", nargs="+", default=None, help="subset of methods (hf-ar always runs)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = GenerationSpec(max_new_tokens=args.new_tokens, do_sample=False, ignore_eos=args.ignore_eos)
    methods = method_specs(args.draft_model)
    if args.methods:
        methods = {m: s for m, s in methods.items() if m in args.methods or m == "hf-ar"}
    results = {"new_tokens": args.new_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
               "suffix_k": SUFFIX_K, "tree": TREE, "suffix": SUFFIX, "runs": {}, "environment": environment()}
    started = time.time()
    for precision in args.precisions:
        target, tokenizer = load_model(ModelSpec(source="embedded", precision=precision, device="cpu"))
        draft = None
        if args.draft_model:
            draft, _ = load_model(ModelSpec(source="embedded", precision="int4", device="cpu"))
        encoder = make_generator("encode", "ar", target, tokenizer, draft, gen)  # chat template, EOS ids
        runners, fresh = make_runners(methods, target, tokenizer, draft, gen, encoder.eos_token_ids(gen))
        for suite in args.suites:
            suite_prompts = load_suite(suite)[: args.prompts or None]
            prompts = [Prompt(p.id, p.kind, encoder.encode(p.prompt)) for p in suite_prompts]
            m = measure(runners, prompts, gen, repeats=args.repeats, warmup=1,
                        warm_gen=dataclasses.replace(gen, max_new_tokens=16), rotate=True, before_repetition=fresh,
                        desc=f"{precision}/{suite}")
            results["runs"][f"{precision} / {suite}"] = {
                "table": table(m), "prompts": [p.id for p in prompts],
                "ratios": {name: m.paired_ratio(a, b, key) for name, (a, b, key) in RATIOS.items()
                           if a in methods and b in methods}}
            print(f"[{time.time() - started:7.1f}s] {precision}/{suite} done", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "tree_bench.json", results)
    atomic_write_text(out / "tree_bench.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
