"""Does ``compile: auto`` pay for each shipped recipe on this CPU? Each recipe at ``compile: off`` against the same
recipe at ``compile: auto`` (the target's forward and a draft LM's each compiled where their own weights pay), same
weights (one model pool), in one process.

    PYTHONPATH=. .venv/bin/python bench/compile_auto.py [--recipes short-exact short-eagle ...] [--suite unseen]
        [--num-prompts 4] [--max-new-tokens 96] [--repeats 3] [--out bench/reports/compile-auto]

Protocol (:func:`toolkit.measure.harness.measure`): both forms warmed up (graphs compiled before timing), one warm-up
call each, then ``--repeats`` repetitions, the two forms interleaved per prompt with the order rotated between
repetitions, every drafter's memory cleared before each repetition; tok/s = new tokens / wall time of the call,
prompt included. Per recipe: the path line of each form, tok/s (median), the paired ratio auto / off (median over
prompts and repetitions), τ, ms per round drafting and verifying (medians), and whether the greedy texts are equal
(fp32 recipes should be; bf16 / int4 ones may part at near-ties, since a compiled graph rounds differently).
Recipes with their own prompt length (``long``: 2,000 new tokens) run at ``--long-new-tokens`` on ``long-heldout``.

Writes ``<out>/compile_auto.json`` and ``<out>/README.md`` with ``lscpu``'s model name and AVX flags.
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

from eval.runners import ours_runner  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.session import ModelPool  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

SUITES = {"unseen": str(ROOT / "bench/prompts/unseen.yaml"), "short": "short", "short-heldout": "short-heldout"}
RECIPES = ["short-exact", "short-ngram", "short-suffix", "short-eagle", "short-draft", "short-draft-tree", "quantspec",
           "long"]
LONG = {"long": "long-heldout"}  # recipes defined by long generations: their own held-out suite


def median(calls, f) -> float:
    return statistics.median(f(c.stats) for c in calls)


def one_recipe(name: str, args) -> dict:
    """Both forms of recipe ``name``, measured side by side."""
    base = Recipe.load(resolve(name, "", "--recipes"))
    new = args.long_new_tokens if name in LONG else args.max_new_tokens
    gen = dataclasses.replace(base.generation, max_new_tokens=new)
    pool, lms, paths = ModelPool(), {}, {}
    for mode in ("off", "auto"):
        lm = build(dataclasses.replace(base, name=f"{name}-{mode}", compile=mode), pool=pool)
        prompts = load_suite(LONG.get(name, SUITES[args.suite]))[: args.num_prompts]
        items = [Prompt(p.id, p.kind, lm.encode(p.prompt, f"prompts.{p.id}")) for p in prompts]
        seconds = lm.warm_up(max(i.input_ids.shape[1] for i in items) + new)
        lms[mode], paths[mode] = lm, {"path": lm.engine_note, "compile_s": round(seconds, 1)}
    eos = sorted(lms["off"].eos_token_ids(gen))
    measured = measure({m: ours_runner(lm, eos) for m, lm in lms.items()}, items, gen, repeats=args.repeats,
                       warmup=1, rotate=True, desc=name,
                       before_repetition=lambda rep: [lm.forget() for lm in lms.values()])
    forms = {}
    for mode in lms:
        calls = [c for i in range(len(items)) for c in measured.per_prompt(mode, i)]
        forms[mode] = {**paths[mode], "tok_s": measured.speed(mode)["throughput"]["median"],
                       "tau": measured.tau(mode), "draft_ms": median(calls, lambda s: s.draft_ms / s.rounds),
                       "verify_ms": median(calls, lambda s: s.target_ms / s.rounds)}
    same = [measured.per_prompt("off", i)[-1].token_ids == measured.per_prompt("auto", i)[-1].token_ids
            for i in range(len(items))]
    return {"recipe": name, "weights": base.target.precision, "prompts": [i.id for i in items],
            "max_new_tokens": new, "forms": forms, "auto_vs_off": measured.paired_ratio("auto", "off"),
            "same_text": same}


def markdown(report: dict) -> str:
    lines = ["# `compile: auto` against `compile: off`, recipe by recipe", "",
             f"CPU: {cpu_line(report['cpu'])}; torch {report['environment'].get('torch', '?')}. Same weights, one "
             f"process, the two forms interleaved, median of {report['repeats']} repetitions, tok/s including the "
             f"prompt; prompts: {report['suite']} (long recipes: their held-out suite).", "",
             "| recipe | target weights | new tokens | off tok/s | auto tok/s | auto / off | τ | draft ms/round off → auto "
             "| verify ms/round off → auto | same text | path at auto |", "|---" * 11 + "|"]
    for r in report["recipes"]:
        off, auto = r["forms"]["off"], r["forms"]["auto"]
        lines.append(f"| {r['recipe']} | {r['weights']} | {r['max_new_tokens']} | {off['tok_s']:.1f} | "
                     f"{auto['tok_s']:.1f} | **{r['auto_vs_off']:.2f}x** | {auto['tau']:.2f} | "
                     f"{off['draft_ms']:.1f} → {auto['draft_ms']:.1f} | {off['verify_ms']:.1f} → "
                     f"{auto['verify_ms']:.1f} | {sum(r['same_text'])}/{len(r['same_text'])} | {auto['path']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--suite", default="unseen", choices=list(SUITES))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--long-new-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/compile-auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"cpu": cpu_isa(), "environment": environment(), "suite": args.suite, "repeats": args.repeats,
              "recipes": []}
    for name in args.recipes:
        report["recipes"].append(one_recipe(name, args))
        print(markdown(report).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "compile_auto.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
