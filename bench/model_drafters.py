"""Does a drafter that runs a network pay on this CPU? Our own AR path against the EAGLE head and a draft model, on
the main recipe's weights (embedded SmolLM2-135M-Instruct, torchao int4 target, ``compile`` as the recipe says).

    PYTHONPATH=. .venv/bin/python bench/model_drafters.py [--recipe short] [--suite unseen] [--repeats 3]
        [--max-new-tokens 96] [--out bench/reports/model-drafters]

Methods, timed interleaved per prompt with the order rotated between repetitions
(:func:`toolkit.measure.harness.measure`), greedy, EOS ignored, the same target weights throughout:

* ``ours AR``: the recipe with no drafter (the compiled static engine where the recipe compiles);
* ``ours lookup``: the recipe itself (for reference: the drafter that needs no network);
* ``ours EAGLE K=N``: the shipped EAGLE-1 head (``toolkit/heads/``, bf16) reading the target's last-layer
  features, constant K; the head's hooks on the target make the target's forward run eager (see
  ``toolkit.engine.forward``), which the per-round breakdown shows;
* ``ours draft model K=4``: the embedded model at int4 as a separate draft model, constant K.

Reported per method: tok/s (median, min-max over repetitions), the ratio to ``ours AR`` (paired within each
repetition, median), tokens per round tau, and where a round's time goes (draft / verify / overhead ms). Writes
``OUT/model_drafters.json`` and ``OUT/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.runners import ours_runner  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.session import SHARED_POOL  # noqa: E402
from toolkit.speculative.stats import round_summary  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

SUITES = {"short": "short", "short-heldout": "short-heldout", "unseen": str(ROOT / "bench/prompts/unseen.yaml")}


def variants(recipe: Recipe, eagle_ks: list[int]) -> dict[str, Recipe]:
    """``{method: recipe}``: the recipe without a drafter, as it is, with the EAGLE head, with a draft model."""
    out = {"ours AR": recipe.replace(spec=SpeculationSpec(drafter="none", adaptive="constant")),
           "ours lookup": recipe}
    head_draft = ModelSpec(source="embedded", precision="bf16", device=recipe.target.device)
    for k in eagle_ks:
        out[f"ours EAGLE K={k}"] = recipe.replace(
            draft=head_draft, spec=SpeculationSpec(drafter="eagle", num_draft_tokens=k, adaptive="constant"))
    draft = dataclasses.replace(recipe.target)
    out["ours draft model K=4"] = recipe.replace(
        draft=draft, spec=SpeculationSpec(drafter="draft_model", num_draft_tokens=4, adaptive="constant"))
    return out


def markdown(report: dict) -> str:
    lines = [f"# Drafters that run a network vs our own AR path ({report['recipe']} recipe's weights, "
             f"{report['suite']} prompts)", "",
             f"{report['max_new_tokens']} new tokens, greedy, EOS ignored, median of {report['repeats']} interleaved "
             f"repetitions (order rotated); {report['environment']['machine']} "
             f"x{report['environment']['cpu_count']}, torch "
             f"{report['environment']['torch']}. Ratios are paired within a repetition.", "",
             "| method | tok/s | min-max | × ours AR | τ | draft ms | verify ms | overhead ms | target path |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["methods"].items():
        t = row["throughput"]
        lines.append(f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | "
                     f"{row['vs_ours_ar']:.2f}× | {row['tau']:.2f} | {row['round_ms']['draft']:.1f} | "
                     f"{row['round_ms']['target']:.1f} | {row['round_ms']['overhead']:.1f} | {row['path']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="short")
    parser.add_argument("--suite", default="unseen", choices=list(SUITES))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eagle-k", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/model-drafters")
    args = parser.parse_args()
    recipe = Recipe.load(resolve(args.recipe, "", "--recipe"))
    recipe = recipe.replace(generation=dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens,
                                                           ignore_eos=True))
    lms = {name: build(r, pool=SHARED_POOL) for name, r in variants(recipe, args.eagle_k).items()}
    first = next(iter(lms.values()))
    prompts = [Prompt(p.id, p.kind, first.encode(p.prompt)) for p in load_suite(SUITES[args.suite])]
    prompts = prompts[: args.num_prompts]
    for lm in lms.values():
        lm.warm_up(max(int(p.input_ids.shape[1]) for p in prompts) + args.max_new_tokens)
    eos = first.eos_token_ids(recipe.generation)
    runners = {name: ours_runner(lm, eos) for name, lm in lms.items()}
    result = measure(runners, prompts, recipe.generation, repeats=args.repeats, rotate=True, desc="model drafters")
    methods = {}
    for name, lm in lms.items():
        round_ms = round_summary([c.stats for rep in result.calls[name] for c in rep])
        methods[name] = {"throughput": result.speed(name)["throughput"], "tau": result.tau(name),
                         "vs_ours_ar": result.paired_ratio(name, "ours AR") or 1.0, "round_ms": round_ms,
                         "path": lm.engine_note}
    report = {"recipe": args.recipe, "suite": args.suite, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "prompts": [p.id for p in prompts], "methods": methods,
              "environment": environment()}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "model_drafters.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
