"""Does padding a round to the cheapest measured width pay? Each recipe with its rounds padded (the planner's rule:
a forward of ``m >= n + 1`` tokens where the target's verify cost curve prices it >= 10% below ``n + 1``, within
:func:`toolkit.engine.planner.verify_room`) against the same recipe with exact widths (``PAD_ROOM = 0``: a constant K
verifies at ``K + 1``), on one built recipe (same weights, same curve), in one process.

    PYTHONPATH=. .venv/bin/python bench/verify_padding.py [--recipes short-eagle short-draft] [--num-prompts 4]
        [--max-new-tokens 96] [--repeats 3] [--curve-repeats 5] [--out bench/reports/verify-padding]

Protocol (:func:`toolkit.measure.harness.measure`): the recipe warmed up (graphs compiled, the curve read or
measured), one warm-up call per form, then ``--repeats`` repetitions, the two forms interleaved per prompt with the
order rotated, the drafter's memory cleared before each repetition; tok/s = new tokens / wall time of the call,
prompt included. Per recipe: the curve's first 8 widths (ms), tok/s (median), the paired ratio padded / exact, τ,
verify ms and forward width per round (medians), whether the greedy texts are equal. Then the curve measured again
``--curve-repeats`` times on the same engine (:func:`toolkit.engine.cost.measure_verify_cost`, widths 1-8): how far
one measurement of a width is from the next, which is what the planner's padding margin
(:data:`toolkit.engine.planner.PAD_MARGIN`) must stand above — per wider width ``m``, the range of
``ms(m) / ms(K + 1)`` over the measurements.

Writes ``<out>/verify_padding.json`` and ``<out>/README.md`` with ``lscpu``'s model name and AVX flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toolkit.engine.planner as planner  # noqa: E402
from eval.runners import ours_runner  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.engine.cost import measure_verify_cost  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

FORMS = {"padded": planner.PAD_ROOM, "exact": 0}  # the room a round may pad to (0: none past K + 1)


def one_recipe(name: str, args) -> dict:
    """Recipe ``name`` padded and exact, measured side by side on one built recipe."""
    recipe = Recipe.load(resolve(name, "", "--recipes"))
    gen = dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens)
    lm = build(recipe)
    prompts = load_suite(str(ROOT / "bench/prompts/unseen.yaml"))[: args.num_prompts]
    items = [Prompt(p.id, p.kind, lm.encode(p.prompt, f"prompts.{p.id}")) for p in prompts]
    lm.warm_up(max(i.input_ids.shape[1] for i in items) + args.max_new_tokens)
    eos = sorted(lm.eos_token_ids(gen))

    def form(room: int):
        run = ours_runner(lm, eos)

        def call(*a, **k):
            planner.PAD_ROOM = room  # read when the call builds its controller (Plan.verify_room)
            return run(*a, **k)
        return call

    measured = measure({f: form(room) for f, room in FORMS.items()}, items, gen, repeats=args.repeats, warmup=1,
                       rotate=True, desc=name, before_repetition=lambda rep: lm.forget())
    planner.PAD_ROOM = FORMS["padded"]
    forms = {}
    for f in FORMS:
        calls = [c.stats for i in range(len(items)) for c in measured.per_prompt(f, i)]
        forms[f] = {"tok_s": measured.speed(f)["throughput"]["median"], "tau": measured.tau(f),
                    "verify_ms": statistics.median(s.target_ms / s.rounds for s in calls),
                    "width": statistics.median(s.verify_tokens / s.rounds for s in calls)}
    same = [measured.per_prompt("padded", i)[-1].token_ids == measured.per_prompt("exact", i)[-1].token_ids
            for i in range(len(items))]
    curves = [[round(x, 1) for x in measure_verify_cost(lm.target, 8, forward=lm.engine).step_ms]
              for _ in range(args.curve_repeats)]  # after the timed calls: the graphs are warm
    return {"recipe": name, "weights": recipe.target.precision, "k": recipe.spec.num_draft_tokens,
            "curve_ms": [round(x, 1) for x in lm.verify_cost_for(16).step_ms[:8]], "path": lm.engine_note,
            "forms": forms, "padded_vs_exact": measured.paired_ratio("padded", "exact"), "same_text": same,
            "margin": planner.PAD_MARGIN, "curves_ms": curves}


def curve_spread(r: dict) -> str:
    """One Markdown row: recipe ``r``'s re-measured curves, per width ``median (min-max)`` ms, and per wider width
    ``m`` the range of ``ms(m) / ms(K + 1)`` over the measurements."""
    curves, k = r["curves_ms"], r["k"]
    cells = []
    for w in range(len(curves[0])):
        values = [c[w] for c in curves]
        cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
    ratios = [f"{m}: {min(c[m - 1] / c[k] for c in curves):.2f}-{max(c[m - 1] / c[k] for c in curves):.2f}"
              for m in range(k + 2, len(curves[0]) + 1)]
    return f"| {r['recipe']} | {len(curves)} | {' / '.join(cells)} | {k + 1} | {'; '.join(ratios) or '-'} |"


def markdown(report: dict) -> str:
    lines = ["# Rounds padded to the cheapest measured width against exact widths", "",
             f"CPU: {cpu_line(report['cpu'])}; torch {report['environment'].get('torch', '?')}. One built recipe, "
             f"the two forms interleaved, median of {report['repeats']} repetitions, {report['max_new_tokens']} new "
             "tokens, tok/s including the prompt; prompts: bench/prompts/unseen.yaml.", "",
             "| recipe | weights | K | curve ms, widths 1-8 | exact tok/s | padded tok/s | padded / exact | τ "
             "| verify ms/round exact → padded | width/round exact → padded | same text |", "|---" * 11 + "|"]
    for r in report["recipes"]:
        exact, padded = r["forms"]["exact"], r["forms"]["padded"]
        lines.append(f"| {r['recipe']} | {r['weights']} | {r['k']} | {' / '.join(map(str, r['curve_ms']))} | "
                     f"{exact['tok_s']:.1f} | {padded['tok_s']:.1f} | **{r['padded_vs_exact']:.2f}x** | "
                     f"{padded['tau']:.2f} | {exact['verify_ms']:.1f} → {padded['verify_ms']:.1f} | "
                     f"{exact['width']:.1f} → {padded['width']:.1f} | {sum(r['same_text'])}/{len(r['same_text'])} |")
    spread = [r for r in report["recipes"] if r.get("curves_ms")]
    if spread:
        lines += ["", f"The curve re-measured on the same engine after the timed calls; the planner pads only where a "
                  f"wider forward is priced below {spread[0]['margin']:.2f}x the exact one:", "",
                  "| recipe | measurements | ms, widths 1-8: median (min-max) | exact width | wider / exact, min-max |",
                  "|---" * 5 + "|"] + [curve_spread(r) for r in spread]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["short-eagle", "short-draft"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--curve-repeats", type=int, default=5, help="re-measure the curve this many times (0: not)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/verify-padding")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"cpu": cpu_isa(), "environment": environment(), "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "recipes": []}
    for name in args.recipes:
        report["recipes"].append(one_recipe(name, args))
        print(markdown({**report, "recipes": report["recipes"][-1:]}).split("\n\n")[2], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "verify_padding.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
