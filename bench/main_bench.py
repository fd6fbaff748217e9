"""The main job against what a user already has, on every kind of prompt, in one process.

    PYTHONPATH=. .venv/bin/python bench/main_bench.py [--recipes short short-exact] [--suites short short-heldout
        unseen repeat] [--repeats 3] [--out bench/results/main]

For each recipe and prompt suite, ``toolkit run --compare`` semantics (:func:`eval.run.run_recipe`): our decoder and,
on the SAME model objects (the recipe's target weights), HF ``generate`` AR, HF prompt lookup with K = 4 and with
K = 10 (max n-gram 3), plus fp32 AR for reference when the target is not fp32; one warm-up call per method, then
``--repeats`` repetitions with the methods interleaved per prompt; a fresh drafter state (memory, calibration) at
every repetition, so memory across requests holds only the earlier prompts of the same repetition. Suites:

* ``short`` — the ``make short`` suite (all six prompts), ``short-heldout`` — the search's held-out prompts,
* ``unseen`` — ``bench/prompts/unseen.yaml``: prompts no suite, search or tuning has seen,
* ``repeat`` — the repeated-request suite (each request asked, then asked again with an edit), in order.

Writes ``<out>/main_bench.json`` (every row of every run), ``<out>/main_bench.md`` (per suite: ours vs each
baseline, the worst prompt vs AR, the per-round time split, output fidelity) and ``<out>/main_bench.png`` (per-prompt
speedups vs HF AR and vs the better HF prompt lookup).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.run import run_recipe  # noqa: E402
from eval.runners import PROMPT_LOOKUPS  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_png, atomic_write_text  # noqa: E402
from toolkit.measure.harness import environment  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.session import SHARED_POOL  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

SUITES = {"short": "short", "short-heldout": "short-heldout", "unseen": str(ROOT / "bench/prompts/unseen.yaml"),
          "repeat": "repeat"}


def per_prompt(result: dict) -> list[dict]:
    """Per prompt: ours' throughput over AR's and over the faster HF prompt lookup's (medians over repetitions)."""
    by_prompt: dict[str, dict] = {}
    for row in result["rows"]:
        by_prompt.setdefault(row["prompt"], {})[row["method"]] = row
    out = []
    for prompt, rows in by_prompt.items():
        ours = rows["ours"]["throughput"]["median"]
        lookup = max((rows[m]["throughput"]["median"] for m in PROMPT_LOOKUPS if m in rows), default=None)
        out.append({"prompt": prompt, "ours": ours, "vs_ar": ours / rows["ar"]["throughput"]["median"],
                    "vs_best_prompt_lookup": ours / lookup if lookup else None,
                    "identical": rows["ours"]["identical_to_ar"], "divergence": rows["ours"].get("divergence")})
    return out


def summarize(name: str, suite: str, result: dict) -> dict:
    s = result["summary"]
    prompts = per_prompt(result)
    target = result["recipe"]["target"]
    weights = target["precision"] + (f" {target['backend']}" if target["precision"] in ("int8", "int4") else "")
    return {"recipe": name, "suite": suite, "weights": weights,
            "throughput": {m: v["throughput"] for m, v in s.items()},
            "speedup": {k[len("speedup_vs_"):]: v for k, v in s["ours"].items() if k.startswith("speedup_vs_")},
            "worst_prompt_vs_ar": min(p["vs_ar"] for p in prompts),
            "worst_prompt_vs_best_prompt_lookup": min(p["vs_best_prompt_lookup"] or 0 for p in prompts),
            "tau": s["ours"]["tokens_per_round"], "alpha": s["ours"]["acceptance_rate"],
            "round_ms": s["ours"]["round_ms"], "agreement": s["ours"].get("agreement"), "prompts": prompts}


def markdown(runs: list[dict], env: dict) -> str:
    lines = ["# Main job vs HF on the same weights", "",
             f"{env['hardware']}, torch {env['torch']}, transformers {env['transformers']}, {env['date']}. "
             "Throughput = new tokens / wall time, median of the repetitions; every method on the same model "
             "objects, interleaved per prompt. `PL` = HF prompt lookup (max n-gram 3), the faster of K = 4 and "
             "K = 10 per suite.", "",
             "| recipe | weights | suite | ours tok/s | HF AR | HF PL K=4 | HF PL K=10 | fp32 HF AR | vs AR | "
             "vs best PL | worst prompt vs AR | τ | ms/round draft + verify + overhead | identical to AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t, sp, rm = r["throughput"], r["speedup"], r["round_ms"]
        best = sp.get("best_prompt_lookup")
        agree = r["agreement"] or {}
        same = f"{agree.get('identical', '-')}/{agree.get('prompts', '-')}"
        if agree.get("max_divergence_margin") is not None:
            same += f" (largest margin {agree['max_divergence_margin']:.2f})"
        fp32_ar = f"{t['ar_fp32']:.1f}" if "ar_fp32" in t else "= HF AR"
        lines.append(
            f"| {r['recipe']} | {r.get('weights', '-')} | {r['suite']} | {t['ours']:.1f} | {t['ar']:.1f} | "
            f"{t.get('prompt_lookup', 0):.1f} | {t.get('prompt_lookup_10', 0):.1f} | {fp32_ar} | {sp['ar']:.2f}× | "
            f"{best:.2f}× | {r['worst_prompt_vs_ar']:.2f}× | {r['tau']:.2f} | "
            f"{rm['draft']:.1f} + {rm['target']:.1f} + {rm['overhead']:.2f} ({rm['overhead_pct']:.1f}%) | {same} |")
    lines += ["", "## Per prompt (ours / HF AR, ours / best HF prompt lookup)", ""]
    for r in runs:
        cells = ", ".join(f"{p['prompt']} {p['vs_ar']:.2f}/{(p['vs_best_prompt_lookup'] or 0):.2f}"
                          for p in r["prompts"])
        lines.append(f"- **{r['recipe']} / {r['suite']}**: {cells}")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 0.25 * sum(len(r["prompts"]) for r in runs) + 1.5), sharey=True)
    labels, vs_ar, vs_pl = [], [], []
    for r in runs:
        for p in r["prompts"]:
            labels.append(f"{r['recipe']}/{r['suite']}/{p['prompt']}")
            vs_ar.append(p["vs_ar"])
            vs_pl.append(p["vs_best_prompt_lookup"] or 0)
    for ax, values, title, bar in ((axes[0], vs_ar, "ours / HF AR", 1.0), (axes[1], vs_pl, "ours / best HF PL", 1.0)):
        ax.barh(range(len(values)), values, color=["tab:green" if v >= bar else "tab:red" for v in values])
        ax.axvline(bar, color="black", lw=0.8)
        ax.set_title(title)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["short", "short-exact"])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/main")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="re-render an earlier main_bench.json's Markdown and plot into --out, measuring nothing")
    args = parser.parse_args()
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        runs = [summarize(r["recipe"], r["suite"], r["result"]) for r in earlier["raw"]]
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "main_bench.md", markdown(runs, earlier["environment"]))
        plot(runs, args.out / "main_bench.png")
        return
    runs, raw = [], []
    for name in args.recipes:
        recipe = Recipe.load(resolve(name, "", "--recipes"))
        if args.max_new_tokens:
            recipe = recipe.replace(generation=recipe.generation.__class__(
                **{**recipe.generation.__dict__, "max_new_tokens": args.max_new_tokens}))
        generator = build(recipe, pool=SHARED_POOL)
        for suite in args.suites:
            result = run_recipe(recipe, compare=True, repeats=args.repeats, prompts=load_suite(SUITES[suite]),
                                generator=generator).to_dict()
            raw.append({"recipe": name, "suite": suite, "result": result})
            runs.append(summarize(name, suite, result))
            print(markdown(runs[-1:], result["environment"]).split("\n")[4 + 2], flush=True)
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "main_bench.json", {"environment": env, "runs": runs, "raw": raw})
    atomic_write_text(args.out / "main_bench.md", markdown(runs, env))
    plot(runs, args.out / "main_bench.png")
    print(markdown(runs, env))


if __name__ == "__main__":
    main()
