"""Does padding a round to the cheapest measured width pay? Each recipe with its rounds padded (the planner's rule:
a forward of ``m >= n + 1`` tokens where the target's verify cost curve prices it >= 2% below ``n + 1``, within
:func:`toolkit.engine.planner.verify_room`) against the same recipe with exact widths (``PAD_ROOM = 0``: a constant K
verifies at ``K + 1``), on one built recipe (same weights, same curve), in one process.

    PYTHONPATH=. .venv/bin/python bench/verify_padding.py [--recipes short-eagle short-draft] [--num-prompts 4]
        [--max-new-tokens 96] [--repeats 3] [--out bench/reports/verify-padding]

Protocol (:func:`toolkit.measure.harness.measure`): the recipe warmed up (graphs compiled, the curve read or
measured), one warm-up call per form, then ``--repeats`` repetitions, the two forms interleaved per prompt with the
order rotated, the drafter's memory cleared before each repetition; tok/s = new tokens / wall time of the call,
prompt included. Per recipe: the curve's first 8 widths (ms), tok/s (median), the paired ratio padded / exact, τ,
verify ms and forward width per round (medians), whether the greedy texts are equal.

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
    return {"recipe": name, "weights": recipe.target.precision, "k": recipe.spec.num_draft_tokens,
            "curve_ms": [round(x, 1) for x in lm.verify_cost_for(16).step_ms[:8]], "path": lm.engine_note,
            "forms": forms, "padded_vs_exact": measured.paired_ratio("padded", "exact"), "same_text": same}


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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["short-eagle", "short-draft"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/verify-padding")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"cpu": cpu_isa(), "environment": environment(), "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "recipes": []}
    for name in args.recipes:
        report["recipes"].append(one_recipe(name, args))
        print(markdown(report).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "verify_padding.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
