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

A *pass* runs every prompt of a suite once, in order, through one fresh Generator per method (so the suffix
drafter's memory holds only the earlier requests of that pass, never an earlier repetition of the same prompt);
per prompt the methods run back to back (interleaved, so load drift on a shared machine hits them alike), their
order rotated between passes. After one untimed warm-up pass on a prompt outside the suites, ``--repeats`` passes
are timed. Reported per method: throughput (new tokens / wall time of the pass; median
and min-max over passes), tokens per round τ (committed / rounds; HF: new tokens per target forward), and whether
every output is token-identical to ``hf-ar``. Ratios (computed within each pass, then the median over passes): tree
vs linear (same drafter), suffix vs ngram / HF prompt lookup / AR.

Writes ``bench/results/tree_bench.json`` and ``bench/results/tree_bench.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toolkit  # noqa: E402
from toolkit.baselines import hf_generate  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.prompts import load_suite  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpecSpec  # noqa: E402
from toolkit.harness import environment  # noqa: E402

SUFFIX_K = 16
SUFFIX = {"drafter": "suffix", "max_spec_factor": 2.0, "min_token_prob": 0.05, "max_cached_requests": 16}
TREE = {"tree_budget": 12, "tree_depth": 16, "tree_topk": 4}
WARMUP = [{"role": "user", "content": "Describe the water cycle in three sentences."}]


def method_specs(draft_model: bool) -> dict[str, SpecSpec | str]:
    methods: dict[str, SpecSpec | str] = {
        "hf-ar": "ar",
        "hf-prompt-lookup": "prompt_lookup",
        "ngram": SpecSpec(drafter="ngram", num_draft_tokens=4, max_ngram=3, min_ngram=1),
        "suffix-linear": SpecSpec(num_draft_tokens=SUFFIX_K, **SUFFIX),
        "suffix-tree": SpecSpec(num_draft_tokens=SUFFIX_K, tree=True, **SUFFIX, **TREE),
    }
    if draft_model:
        methods["self-linear"] = SpecSpec(drafter="self", num_draft_tokens=4)
        methods["self-tree"] = SpecSpec(drafter="self", num_draft_tokens=4, tree=True, tree_budget=16,
                                        tree_depth=5, tree_topk=4)
    return methods


def make_generator(method: str, spec, target, tokenizer, draft, gen: GenerationSpec):
    """A fresh Generator for ``method`` (a fresh suffix memory); ``spec`` is a SpecSpec or an HF baseline name."""
    hf = isinstance(spec, str)
    recipe = Recipe(name=f"tree-bench-{method}", target=ModelSpec(source="embedded"),
                    draft=ModelSpec(source="embedded", precision="int4") if not hf and spec.drafter == "self" else None,
                    spec=SpecSpec(drafter="none") if hf else spec, generation=gen)
    return toolkit.build(recipe, target=target, tokenizer=tokenizer,
                         draft_model=draft if recipe.draft is not None else None)


def run_one(generator, spec, prompt, gen: GenerationSpec) -> tuple[list[int], float, int, int]:
    """``(ids, seconds, rounds, committed)`` of one prompt (HF rows: rounds = target forwards after prefill)."""
    if isinstance(spec, str):
        out, stats = hf_generate(generator.target, generator.encode(prompt.prompt), gen,
                                 generator.eos_token_ids(gen), method=spec, num_draft_tokens=4, max_ngram=3)
        return out, stats.total_ms / 1000, max(stats.target_forwards - 1, 1), max(stats.new_tokens - 1, 0)
    result = generator.generate(prompt.prompt)
    return result.token_ids, result.stats.total_ms / 1000, result.stats.rounds, result.stats.committed


def run_pass(methods: dict, order: list[str], target, tokenizer, draft, prompts, gen: GenerationSpec) -> dict:
    """Every prompt once, in order; per prompt every method in ``order`` (interleaved, so load drift on a shared
    machine hits all methods alike). One fresh Generator per method and pass: the suffix drafter remembers only the
    earlier prompts of this pass. Returns ``{method: {ids, seconds, tokens, throughput, tau}}``."""
    generators = {m: make_generator(m, methods[m], target, tokenizer, draft, gen) for m in order}
    acc = {m: {"ids": {}, "seconds": 0.0, "tokens": 0, "rounds": 0, "committed": 0} for m in order}
    for prompt in prompts:
        for m in order:
            ids, seconds, rounds, committed = run_one(generators[m], methods[m], prompt, gen)
            a = acc[m]
            a["ids"][prompt.id] = ids
            a["seconds"] += seconds
            a["tokens"] += len(ids)
            a["rounds"] += rounds
            a["committed"] += committed
    return {m: {"ids": a["ids"], "seconds": a["seconds"], "tokens": a["tokens"],
                "throughput": a["tokens"] / a["seconds"], "tau": a["committed"] / a["rounds"] if a["rounds"] else 0.0}
            for m, a in acc.items()}


def summarize(passes: list[dict]) -> dict:
    values = [p["throughput"] for p in passes]
    return {"throughput": statistics.median(values), "throughput_min": min(values), "throughput_max": max(values),
            "tau": statistics.median(p["tau"] for p in passes), "tokens": passes[-1]["tokens"],
            "passes": len(passes)}


def ratios(passes: dict[str, list[dict]]) -> dict:
    """Ratios between methods, computed within each pass (same load) and then the median over passes."""
    def r(a, b, key="throughput"):
        if a not in passes or b not in passes:
            return None
        values = [x[key] / y[key] for x, y in zip(passes[a], passes[b]) if y[key]]
        return statistics.median(values) if values else None

    out = {
        "suffix_tree_vs_linear_throughput": r("suffix-tree", "suffix-linear"),
        "suffix_tree_vs_linear_tau": r("suffix-tree", "suffix-linear", "tau"),
        "suffix_tree_vs_hf_prompt_lookup": r("suffix-tree", "hf-prompt-lookup"),
        "suffix_tree_vs_ngram": r("suffix-tree", "ngram"),
        "suffix_tree_vs_ar": r("suffix-tree", "hf-ar"),
        "suffix_linear_vs_hf_prompt_lookup": r("suffix-linear", "hf-prompt-lookup"),
        "suffix_linear_vs_ar": r("suffix-linear", "hf-ar"),
        "ngram_vs_ar": r("ngram", "hf-ar"),
        "hf_prompt_lookup_vs_ar": r("hf-prompt-lookup", "hf-ar"),
    }
    if "self-tree" in passes:
        out["self_tree_vs_linear_throughput"] = r("self-tree", "self-linear")
        out["self_tree_vs_linear_tau"] = r("self-tree", "self-linear", "tau")
    return out


def markdown(results: dict) -> str:
    lines = ["# Tree speculation and the suffix drafter (embedded SmolLM2-135M, CPU)", "",
             f"greedy, max_new_tokens={results['new_tokens']}, EOS {'ignored' if results['ignore_eos'] else 'kept'}, "
             f"{results['repeats']} timed passes per method (median, min-max); suffix K={SUFFIX_K}, tree {TREE}.", ""]
    for key, block in results["runs"].items():
        lines += [f"## {key}", "", "| method | throughput (tok/s) | min-max | τ (tokens/round) | vs hf-ar | "
                  "identical to AR |", "|---|---|---|---|---|---|"]
        ar = block["table"].get("hf-ar", {}).get("throughput")
        for method, row in block["table"].items():
            vs = f"{row['throughput'] / ar:.2f}×" if ar else "-"
            lines.append(f"| {method} | {row['throughput']:.1f} | {row['throughput_min']:.1f}–"
                         f"{row['throughput_max']:.1f} | {row['tau']:.2f} | {vs} | {row['identical_to_ar']} |")
        lines += ["", "| ratio (within a pass, median over passes) | value |", "|---|---|"]
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
        warm = [dataclasses.replace(load_suite("short")[0], id="warmup", prompt=WARMUP)]
        run_pass(methods, list(methods), target, tokenizer, draft, warm,  # untimed warm-up, thrown away
                 dataclasses.replace(gen, max_new_tokens=16))
        for suite in args.suites:
            prompts = load_suite(suite)
            if args.prompts:
                prompts = prompts[: args.prompts]
            passes: dict[str, list[dict]] = {m: [] for m in methods}
            names = list(methods)
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[: rep % len(names)]
                result = run_pass(methods, order, target, tokenizer, draft, prompts, gen)
                for method in names:
                    passes[method].append(result[method])
                    print(f"[{time.time() - started:7.1f}s] {precision}/{suite} pass {rep + 1} {method}: "
                          f"{result[method]['throughput']:.1f} tok/s, tau {result[method]['tau']:.2f}", flush=True)
            ar_ids = passes["hf-ar"][-1]["ids"]
            table = {}
            for method in names:
                table[method] = summarize(passes[method])
                table[method]["identical_to_ar"] = all(p["ids"] == ar_ids for p in passes[method])
            results["runs"][f"{precision} / {suite}"] = {"table": table, "ratios": ratios(passes),
                                                          "prompts": [p.id for p in prompts]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "tree_bench.json", results)
    atomic_write_text(out / "tree_bench.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
