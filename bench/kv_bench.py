"""KV-cache compression benchmark on the embedded model (CPU): memory, speed, acceptance and held-out PPL.

    PYTHONPATH=. .venv/bin/python bench/kv_bench.py [--new-tokens 2000] [--repeats 3] [--ppl-tokens 2048]

1. Generation: one chat prompt, ``--new-tokens`` greedy tokens (EOS ignored), the n-gram (prompt-lookup) drafter
   with K = ``--k``, uncompressed vs StreamingLLM (4 sinks + 252 window = budget 256). Runs alternate between the
   two configurations after a warm-up; medians (min-max) over ``--repeats`` runs. Reports exact KV bytes (final
   and peak; sum of cache tensor nbytes), compressions, throughput, acceptance rate and tokens per round.
2. Perplexity of held-out text (GPL-3 license text, not used by calibration), teacher-forced in chunks of K + 1
   tokens through each cache, committing after every chunk — the access pattern of speculative verification:
   none, L2-norm (keep_ratio 0.5), StreamingLLM 4 + 252, head-aware (keep_ratio 0.5: the same bytes as L2).

Writes ``bench/results/kv_bench.json`` and ``bench/results/kv_bench.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.metrics import perplexity_through_cache  # noqa: E402
from eval.runners import ours_runner  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.kv import make_policy  # noqa: E402
from toolkit.measure.harness import Call, Prompt, measure  # noqa: E402
from toolkit.measure.timing import Summary  # noqa: E402
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec  # noqa: E402
from toolkit.session import ModelPool  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

PROMPT = ("Write a detailed, multi-chapter guide to learning the Python programming language, from installing it "
          "to writing tests, packaging and profiling. Use headings and code examples.")
STREAMING = {"sink_tokens": 4, "window": 252}
PPL_POLICIES = {
    "none": KVSpec("none"),
    "l2norm (keep_ratio 0.5)": KVSpec("l2norm", {"keep_ratio": 0.5}),
    "streaming (4 + 252)": KVSpec("streaming", STREAMING),
    "head_aware (keep_ratio 0.5)": KVSpec("head_aware", {"keep_ratio": 0.5}),
}


def recipe(kv: KVSpec, k: int, new_tokens: int) -> Recipe:
    """The benchmarked recipe: fp32 embedded target, n-gram drafter with constant K, greedy, EOS ignored."""
    return Recipe(name=f"kv-bench-{kv.policy}", target=ModelSpec(source="embedded", precision="fp32", device="cpu"),
                  draft=None, kv=kv,
                  spec=SpeculationSpec(drafter="ngram", num_draft_tokens=k, max_ngram=3, min_ngram=1),
                  generation=GenerationSpec(max_new_tokens=new_tokens, ignore_eos=True))


def summarize(calls: list[Call]) -> dict:
    """Median (min-max) over repetitions of the generation metrics of one configuration."""
    metrics = {"throughput": "throughput", "acceptance_rate": "acceptance_rate",
               "tokens_per_round": "tokens_per_round", "kv_bytes_final": "kv_bytes_target",
               "kv_bytes_peak": "peak_kv_bytes_target", "compressions": "compressions_target"}
    return {key: Summary.of([getattr(c.stats, attr) for c in calls]).to_dict() for key, attr in metrics.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--ppl-text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 avoids oversubscription on a "
                        "busy machine)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pool = ModelPool()  # both recipes share one loaded target
    model, tokenizer = pool.get(ModelSpec(source="embedded", precision="fp32", device="cpu"), "target")
    result = {"model": "embedded SmolLM2-135M-Instruct fp32", "device": "cpu", "threads": torch.get_num_threads(),
              "drafter": f"ngram (prompt lookup, max_ngram 3), K={args.k}", "new_tokens": args.new_tokens}

    if not args.skip_generation:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                   return_tensors="pt")
        prompt_ids = prompt_ids if torch.is_tensor(prompt_ids) else prompt_ids["input_ids"]
        configs = {"uncompressed": KVSpec("none"), "streaming 4+252": KVSpec("streaming", STREAMING)}
        generators = {name: build(recipe(kv, args.k, args.new_tokens), pool=pool) for name, kv in configs.items()}
        measured = measure({name: ours_runner(g, []) for name, g in generators.items()},
                           [Prompt("guide", "chat", prompt_ids)],
                           GenerationSpec(max_new_tokens=args.new_tokens, ignore_eos=True), repeats=args.repeats,
                           warmup=1, warm_gen=GenerationSpec(max_new_tokens=32, ignore_eos=True), desc="kv bench")
        runs = {name: measured.per_prompt(name, 0) for name in configs}
        gen = {name: summarize(r) for name, r in runs.items()}
        base, comp = gen["uncompressed"], gen["streaming 4+252"]
        gen["ratios (streaming / uncompressed)"] = {
            key: comp[key]["median"] / base[key]["median"]
            for key in ("throughput", "acceptance_rate", "tokens_per_round", "kv_bytes_final", "kv_bytes_peak")}
        result["prompt_tokens"] = prompt_ids.shape[1]
        result["generation"] = gen

    text = Path(args.ppl_text).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.ppl_tokens]
    result["ppl_text"] = f"{args.ppl_text}, first {ids.shape[1]} tokens, chunks of K+1={args.k + 1}"
    result["perplexity"] = {}
    for name, kv in PPL_POLICIES.items():
        ppl = perplexity_through_cache(model, ids[0].tolist(), make_policy(kv), chunk=args.k + 1)
        result["perplexity"][name] = {"ppl": ppl["value"], "tokens": ppl["tokens"],
                                      "kv_bytes_peak": ppl["peak_kv_bytes"]}
        print(f"[ppl] {name}: {result['perplexity'][name]}", flush=True)

    out = Path(args.out)
    atomic_write_json(out / "kv_bench.json", result)
    atomic_write_text(out / "kv_bench.md", markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# KV compression benchmark — {result['model']}, {result['device']} ({result['threads']} threads)", ""]
    if "generation" in result:
        gen = result["generation"]
        lines += [f"Generation: {result['new_tokens']} new tokens after a {result['prompt_tokens']}-token prompt, "
                  f"greedy, drafter {result['drafter']}; median (min-max) of the runs.", "",
                  "| cache | throughput (tok/s) | acceptance | tokens/round | KV bytes final | KV bytes peak | "
                  "compressions |", "|---|---|---|---|---|---|---|"]
        for name in ("uncompressed", "streaming 4+252"):
            g = gen[name]

            def fmt(key, spec=".2f"):
                return f"{g[key]['median']:{spec}} ({g[key]['min']:{spec}}-{g[key]['max']:{spec}})"
            lines.append(f"| {name} | {fmt('throughput')} | {fmt('acceptance_rate', '.3f')} | "
                         f"{fmt('tokens_per_round')} | {g['kv_bytes_final']['median']:,.0f} | "
                         f"{g['kv_bytes_peak']['median']:,.0f} | {g['compressions']['median']:.0f} |")
        r = gen["ratios (streaming / uncompressed)"]
        lines += ["", "Streaming / uncompressed: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), ""]
    lines += [f"Perplexity: {result['ppl_text']} (eval.metrics.perplexity_through_cache).", "",
              "| policy | PPL | KV bytes peak |", "|---|---|---|"]
    for name, p in result["perplexity"].items():
        lines.append(f"| {name} | {p['ppl']:.3f} | {p['kv_bytes_peak']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
