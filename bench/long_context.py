"""KV compression where the KV cache matters: ~4,000-token documents on the embedded model, in one process.

    PYTHONPATH=. .venv/bin/python bench/long_context.py [--suites long-context long-context-heldout] [--repeats 3]
        [--max-new-tokens 128] [--budget 512] [--out bench/results/long-context]

At 4k tokens of context the embedded SmolLM2-135M's KV cache (fp32 on a CPU: 30 layers x 2 x 3 KV heads x 64 dims x
4 bytes = 46 KiB per token, ~190 MiB) outweighs its native int4 weights (~100 MiB): every decode step reads it
all. On the same target object (the recipe's native weights, the main recipe's lookup drafter and cost-aware
verify length), interleaved per prompt, median of ``--repeats``:

* ``none`` — our decoder, uncompressed static cache, compiled (the main recipe at this length);
* ``l2`` / ``head_aware`` / ``streaming`` — the same with L2-norm (Devoto et al. 2024) and head-aware eviction
  (``--budget`` tokens per head, static tiers compacted at commit points) or the StreamingLLM ring (4 sinks +
  ``budget - 4`` window), compiled;
* ``kivi`` — KIVI (Liu et al., ICML 2024): 4-bit keys per channel / values per token in groups of 32, 4 sinks and a
  128-token full-precision residual, compiled;
* ``streaming_rolling`` — StreamingLLM as the paper runs it (``exact_window: false``: every query sees all the cache
  holds, compacted at commit points; :mod:`toolkit.kv.static_stream`), compiled;
* ``l2_eager`` / ``streaming_eager`` / ``kivi_eager`` — ``l2`` / ``streaming`` / ``kivi`` with ``compile: off``
  (their own eager forms);
* HF ``generate`` on the same weights: eager AR (``ar``), static cache + ``torch.compile`` (``ar_static``), prompt
  lookup K = 10 (``prompt_lookup_10``).

Per method: tok/s (new tokens / wall time, prompt included), TTFT, TPOT, KV bytes allocated (the target cache's
buffers), ROUGE-L F1 of its answer (the text up to the first EOS: the timed calls ignore EOS so that every method
generates the same number of tokens) against the suite's written reference answers (``reference`` in
``recipes/prompts/long-context*.yaml``) and that score over ``none``'s (the issue's "ROUGE-L >= 0.9 of the uncompressed
recipe's"), ROUGE-L of its text against ``none``'s text (greedy texts drift apart at this length even between lossless
paths, so this one is a strict yardstick) and, once per policy, teacher-forced perplexity through the policy's cache
over a held-out document of ``--ppl-tokens`` tokens (chunks of K + 1 = 17).
Writes ``long_context.json``, ``long_context.md`` and ``long_context.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.metrics import perplexity_through_cache  # noqa: E402
from eval.runners import engine_runners, ours_runner, runners_for, static_cache_len  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_png, atomic_write_text  # noqa: E402
from toolkit.kv import make_policy  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import KVSpec, Recipe  # noqa: E402
from toolkit.session import SHARED_POOL  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

BASELINES = ["ar", "ar_static", "prompt_lookup_10"]
#: llama.cpp's own AR on the recipe's GGUF (a worker process; where llama-cpp-python is installed: ``make llamacpp``)
LLAMACPP = "llamacpp_ar"
SUITES = ["long-context", "long-context-heldout"]


def policies(budget: int) -> dict[str, dict]:
    """Our variants: name -> (kv section, compile mode)."""
    evict = {"budget": budget, "sink_tokens": 4, "protect_recent": 64, "compress_interval": 32}
    kivi = {"policy": "quantized", "quant_bits": 4, "quant_group_size": 32, "residual_length": 128, "sink_tokens": 4}
    return {"none": ({"policy": "none"}, "auto"),
            "l2": ({"policy": "l2norm", **evict}, "auto"),
            "head_aware": ({"policy": "head_aware", **evict}, "auto"),
            "streaming": ({"policy": "streaming", "sink_tokens": 4, "window": budget - 4, "compress_interval": 32},
                          "auto"),
            "streaming_rolling": ({"policy": "streaming", "sink_tokens": 4, "window": budget - 4,
                                   "compress_interval": 32, "exact_window": False}, "auto"),
            "kivi": (kivi, "auto"),
            "l2_eager": ({"policy": "l2norm", **evict}, "off"),
            "streaming_eager": ({"policy": "streaming", "sink_tokens": 4, "window": budget - 4,
                                 "compress_interval": 32}, "off"),
            "kivi_eager": (kivi, "off")}


def recipe_for(name: str, kv: dict, compile_mode: str, new_tokens: int) -> Recipe:
    """The main recipe (native weights, lookup drafter, cost-aware K) with ``kv`` and ``compile_mode``."""
    base = Recipe.load(ROOT / "recipes/short.yaml")
    recipe = base.replace(kv=KVSpec.from_dict(kv, "kv"), compile=compile_mode,
                          generation=dataclasses.replace(base.generation, max_new_tokens=new_tokens, ignore_eos=True))
    return dataclasses.replace(recipe, name=f"long-context-{name}")


def rouge(metric, prediction: str, reference: str | None) -> float | None:
    """ROUGE-L F1 of ``prediction`` against ``reference`` through ``metric`` (the toolkit's shipped ``rouge_l``
    module, loaded once per suite); ``None`` without a reference."""
    if reference is None:
        return None
    return float(metric.compute(predictions=[prediction], references=[reference])["rouge_l"])


def run_suite(suite: str, generators: dict, repeats: int, new_tokens: int, num_prompts: int | None = None,
              baselines: list[str] = BASELINES) -> dict:
    """Every method on the first ``num_prompts`` prompts of ``suite`` (all: ``None``), interleaved; per method and
    prompt the medians."""
    from toolkit.metrics import load

    main = generators["none"]
    prompts = [Prompt(p.id, p.kind, main.encode(p.prompt, f"prompts.{p.id}"), p.reference)
               for p in load_suite(suite)[:num_prompts]]
    gen = main.recipe.generation
    eos = main.eos_token_ids(gen)
    longest = max(int(p.input_ids.shape[1]) for p in prompts) + new_tokens
    runners = {name: ours_runner(g, eos) for name, g in generators.items()}
    for name, g in generators.items():
        g.warm_up(longest)
    static_len = static_cache_len([int(p.input_ids.shape[1]) for p in prompts], new_tokens)
    with engine_runners(main.recipe, baselines, eos) as engines:  # llama.cpp's worker, when asked for
        runners |= runners_for(main, baselines, eos, static_cache_len=static_len, engine_calls=engines)
        measured = measure(runners, prompts, gen, repeats=repeats, warmup=1, desc=suite, rotate=True,
                           warm_gen=dataclasses.replace(gen, max_new_tokens=8),
                           before_repetition=lambda rep: [g.forget() for g in generators.values()])

    def answer(method: str, i: int) -> list[int]:  # timed with ignore_eos: what a user reads ends at the first EOS
        ids = list(measured.per_prompt(method, i)[-1].token_ids)
        return ids[:next((k for k, t in enumerate(ids) if t in eos), len(ids))]

    def text(ids: list[int]) -> str:
        return main.tokenizer.decode(ids, skip_special_tokens=True)

    metric, rows = load("rouge_l"), []
    for i, prompt in enumerate(prompts):
        uncompressed = text(answer("none", i))
        for method in measured.methods:
            calls, ids = measured.per_prompt(method, i), answer(method, i)
            generated = text(ids)
            stats = [c.stats for c in calls]
            median = sorted(s.throughput for s in stats)[len(stats) // 2]
            rows.append({"prompt": prompt.id, "prompt_tokens": int(prompt.input_ids.shape[1]), "method": method,
                         "throughput": median, "ttft_ms": sorted(s.ttft_ms for s in stats)[len(stats) // 2],
                         "tpot_ms": sorted(s.tpot_ms for s in stats)[len(stats) // 2],
                         "new_tokens": stats[-1].new_tokens, "tokens_per_round": stats[-1].tokens_per_round,
                         "kv_bytes": stats[-1].peak_kv_bytes_target or None,
                         "answer_tokens": len(ids), "text": generated,
                         "rouge_l_vs_reference": rouge(metric, generated, prompt.reference),
                         "rouge_l_vs_none": rouge(metric, generated, uncompressed)})
    return {"suite": suite, "rows": rows, "summary": summarize(rows, list(measured.methods))}


def summarize(rows: list[dict], methods: list[str]) -> dict:
    """Per method: tok/s over the suite (total new tokens / total time), mean ROUGE-L, KV bytes, ratios."""
    out = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        seconds = sum(r["new_tokens"] / r["throughput"] for r in mine)
        decode_s = sum(r["tpot_ms"] * (r["new_tokens"] - 1) for r in mine) / 1000
        out[method] = {"throughput": sum(r["new_tokens"] for r in mine) / seconds,
                       "decode_throughput": sum(r["new_tokens"] - 1 for r in mine) / decode_s,
                       "ttft_ms": sum(r["ttft_ms"] for r in mine) / len(mine),
                       "rouge_l_vs_none": sum(r["rouge_l_vs_none"] for r in mine) / len(mine),
                       "rouge_l_vs_reference": _mean([r.get("rouge_l_vs_reference") for r in mine]),
                       "kv_bytes": max((r["kv_bytes"] or 0) for r in mine) or None,
                       "worst_prompt_vs_none": min(r["throughput"] / n["throughput"] for r, n in zip(
                           mine, [x for x in rows if x["method"] == "none"]))}
    best_hf = max((out[m]["throughput"] for m in BASELINES if m in out), default=float("nan"))
    best_hf_decode = max((out[m]["decode_throughput"] for m in BASELINES if m in out), default=float("nan"))
    for method in out:
        if LLAMACPP in out:
            out[method]["vs_llamacpp"] = out[method]["throughput"] / out[LLAMACPP]["throughput"]
        out[method]["vs_none"] = out[method]["throughput"] / out["none"]["throughput"]
        out[method]["vs_best_hf"] = out[method]["throughput"] / best_hf
        out[method]["decode_vs_none"] = out[method]["decode_throughput"] / out["none"]["decode_throughput"]
        out[method]["decode_vs_best_hf"] = out[method]["decode_throughput"] / best_hf_decode
        if out[method]["rouge_l_vs_reference"] is not None and out["none"]["rouge_l_vs_reference"]:
            out[method]["reference_vs_none"] = out[method]["rouge_l_vs_reference"] / out["none"]["rouge_l_vs_reference"]
        if out[method]["kv_bytes"] and out["none"]["kv_bytes"]:
            out[method]["kv_vs_none"] = out[method]["kv_bytes"] / out["none"]["kv_bytes"]
    return out


def _mean(values: list[float | None]) -> float | None:
    """The mean of ``values``; ``None`` when any is missing (a prompt without a written reference)."""
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def perplexities(generators: dict, tokens: int) -> dict:
    """Teacher-forced PPL through each policy's cache over ``tokens`` held-out prose tokens (chunks of 17)."""
    from eval.data import heldout_ids

    main = generators["none"]
    ids = heldout_ids(main.tokenizer, "prose", tokens)
    out = {}
    for name, g in generators.items():
        if name.endswith("_eager"):
            continue
        kv = g.recipe.kv
        policy = None if kv.policy == "none" else make_policy(KVSpec(kv.policy, dict(kv.params)))
        out[name] = perplexity_through_cache(g.target, ids, policy, chunk=17)["value"]
    return {name: {"ppl": value, "vs_none": value / out["none"]} for name, value in out.items()}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# KV compression at ~4k-token context ({env.get('hardware')})", "",
             "Paths: " + "; ".join(f"{k}: {v}" for k, v in report["paths"].items()), ""]
    for suite in report["suites"]:
        cpp = LLAMACPP in suite["summary"]
        lines += [f"## {suite['suite']}", "", "tok/s: new tokens / wall time, the ~4k-token prefill included; decode "
                  "tok/s: after the first token (1000 / TPOT).", "",
                  "| method | tok/s | vs none | vs best HF | " + ("vs llama.cpp AR | " if cpp else "") +
                  "decode tok/s | vs none | vs best HF | TTFT s | KV MiB | KV vs none | ROUGE-L vs reference | "
                  "vs none's | ROUGE-L vs none's text |",
                  "|---|---|---|---|" + ("---|" if cpp else "") + "---|---|---|---|---|---|---|---|---|"]
        for method, s in suite["summary"].items():
            kv = f"{s['kv_bytes'] / 2**20:.1f}" if s["kv_bytes"] else "–"
            vs_cpp = f"{s['vs_llamacpp']:.2f}x | " if cpp else ""
            lines.append(f"| {method} | {s['throughput']:.2f} | {s['vs_none']:.2f}x | {s['vs_best_hf']:.2f}x | {vs_cpp}"
                         f"{s['decode_throughput']:.1f} | {s['decode_vs_none']:.2f}x | {s['decode_vs_best_hf']:.2f}x | "
                         f"{s['ttft_ms'] / 1000:.1f} | {kv} | {s.get('kv_vs_none', float('nan')):.3f} | "
                         f"{_num(s.get('rouge_l_vs_reference'), '.3f')} | "
                         f"{_num(s.get('reference_vs_none'), '.2f', 'x')} | "
                         f"{s['rouge_l_vs_none']:.3f} |")
        lines.append("")
    if report.get("ppl"):
        lines += ["## Perplexity through the cache", "", "| policy | PPL | vs none |", "|---|---|---|"]
        lines += [f"| {k} | {v['ppl']:.3f} | {v['vs_none']:.3f}x |" for k, v in report["ppl"].items()]
    return "\n".join(lines) + "\n"


def _num(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else format(value, spec) + unit


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["suites"]), figsize=(6 * len(report["suites"]), 4), squeeze=False)
    for ax, suite in zip(axes[0], report["suites"]):
        names = list(suite["summary"])
        ax.bar(names, [suite["summary"][n]["throughput"] for n in names])
        ax.set_title(suite["suite"])
        ax.set_ylabel("tok/s (prompt included)")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=SUITES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="0: skip the perplexity section")
    parser.add_argument("--methods", nargs="+", default=None, help="our variants to run (default: all)")
    parser.add_argument("--baselines", nargs="+", default=BASELINES, choices=BASELINES + [LLAMACPP],
                        help=f"baselines to run: HF's, and {LLAMACPP} (llama.cpp's AR on the same GGUF, if installed)")
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each suite")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/long-context")
    parser.add_argument("--render", action="store_true", help="only re-render --out's JSON (Markdown and plot)")
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads((args.out / "long_context.json").read_text())
        for suite in report["suites"]:
            suite["summary"] = summarize(suite["rows"], list(dict.fromkeys(r["method"] for r in suite["rows"])))
        return _write(report, args.out)
    variants = {k: v for k, v in policies(args.budget).items() if args.methods is None or k in args.methods}
    variants = {"none": policies(args.budget)["none"]} | variants
    generators = {name: build(recipe_for(name, kv, mode, args.max_new_tokens), pool=SHARED_POOL)
                  for name, (kv, mode) in variants.items()}
    report = {"environment": environment(), "budget": args.budget, "max_new_tokens": args.max_new_tokens,
              "paths": {name: g.engine_note for name, g in generators.items()}, "suites": []}
    for suite in args.suites:
        report["suites"].append(run_suite(suite, generators, args.repeats, args.max_new_tokens, args.num_prompts,
                                          args.baselines))
        report["paths"] = {name: g.engine_note for name, g in generators.items()}
        atomic_write_json(args.out / "long_context.json", report)
    if args.ppl_tokens:
        report["ppl"] = perplexities(generators, args.ppl_tokens)
    _write(report, args.out)


def _write(report: dict, out: Path) -> None:
    atomic_write_json(out / "long_context.json", report)
    atomic_write_text(out / "long_context.md", markdown(report))
    plot(report, out / "long_context.png")
    print(markdown(report))
    print(json.dumps(report["paths"], indent=1))


if __name__ == "__main__":
    main()
