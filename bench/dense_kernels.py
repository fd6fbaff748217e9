"""Do the kernels ``load_model`` picks for dense CPU layers pay? A recipe built twice from the same weights in one
process, as loaded against PyTorch's default kernel, interleaved. ``--kernel`` picks the choice measured:

* ``packed-fp32`` (:mod:`toolkit.quant.packed_fp32`): fp32 linears on oneDNN's GEMM over weights prepacked once,
  against MKL's sgemm (``TOOLKIT_FP32_KERNEL=onednn`` / ``mkl`` while building); default recipes ``short-exact``,
  ``short-eagle``, ``short-draft`` (fp32 targets);
* ``fp32-products`` (:mod:`toolkit.quant.fp32_products`): bf16 layers multiplying in fp32 from 8 rows on, against
  PyTorch's emulated bf16 kernel, on a CPU without BF16 instructions (elsewhere the script says so and stops);
  default recipe ``short-suffix``.

    PYTHONPATH=. .venv/bin/python bench/dense_kernels.py --kernel packed-fp32 [--recipes ...] [--num-prompts 4]
        [--max-new-tokens 96] [--repeats 3] [--prompt-lengths 300 1000] [--out bench/reports/<kernel>]

Protocol (:func:`toolkit.measure.harness.measure`): both builds warmed up (graphs compiled, each one's verify cost
curve read or measured: the planner of each plans on its own curve), one warm-up call per form, then ``--repeats``
repetitions, the two forms interleaved per prompt with the order rotated, the drafter's memory cleared before each
repetition; tok/s = new tokens / wall time of the call, prompt included. Per recipe: each form's verify cost curve
(ms, widths 1-16), draft and verify ms per round and a round's cost in one-token steps (``--ar-step``: each form's
plain AR on the same target, timed among the rest; else the re-measured curve's width 1), tok/s
and TTFT (medians), the paired ratio, τ, verify width per round, whether the greedy texts are equal (the two kernels
sum in another order, so texts may part at near-ties: where they part, the default kernel's top-2 margin there,
:func:`eval.fidelity.first_divergence`); and the target's forward over prompts of ``--prompt-lengths`` tokens both
ways. Writes ``<out>/dense_kernels.json`` and ``<out>/README.md`` with ``lscpu``'s model name and AVX flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.fidelity import first_divergence  # noqa: E402
from eval.runners import ours_runner  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.engine.cost import measure_verify_cost  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.quant import fp32_products  # noqa: E402
from toolkit.quant.int4_linear import native_bf16  # noqa: E402
from toolkit.recipe import Recipe, SpeculationSpec  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel choice of :func:`toolkit.models.load_model`: its two forms (as loaded, PyTorch's default), how each
    is built, the recipes it concerns and the report's title."""

    forms: tuple[str, str]
    patches: tuple[Callable[[], AbstractContextManager], ...]  # per form: the context it is built under
    recipes: tuple[str, ...]
    title: str
    applies: Callable[[], str | None]  # why the comparison is empty on this machine, or None


KERNELS = {
    "packed-fp32": Kernel(
        ("onednn_packed", "mkl"),
        (lambda: mock.patch.dict(os.environ, {"TOOLKIT_FP32_KERNEL": "onednn"}),
         lambda: mock.patch.dict(os.environ, {"TOOLKIT_FP32_KERNEL": "mkl"})),
        ("short-exact", "short-eagle", "short-draft"),
        "fp32 linears on oneDNN's prepacked GEMM against MKL's sgemm",
        lambda: None if torch.backends.mkldnn.is_available() else "this PyTorch has no oneDNN"),
    "fp32-products": Kernel(
        ("fp32_products", "bf16_kernel"),
        (lambda: contextlib.nullcontext(), lambda: mock.patch.object(fp32_products, "native_bf16", lambda: True)),
        ("short-suffix",),
        "bf16 layers multiplying in fp32 against PyTorch's bf16 kernel, on a CPU without BF16 instructions",
        lambda: ("this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): bf16 layers keep PyTorch's kernel, "
                 "there is nothing to compare") if native_bf16() else None),
}


def builds(recipe: Recipe, kernel: Kernel) -> dict:
    """The recipe built twice from the same weights, each form under its patch while loading."""
    lms = {}
    for form, patch in zip(kernel.forms, kernel.patches):
        with patch():
            lms[form] = build(recipe)
    return lms


def one_recipe(name: str, kernel: Kernel, args) -> dict:
    """Recipe ``name`` in both forms, measured side by side."""
    recipe = Recipe.load(resolve(name, "", "--recipes"))
    if args.num_draft_tokens:
        recipe = recipe.replace(spec=dataclasses.replace(recipe.spec, num_draft_tokens=args.num_draft_tokens))
    gen = dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens)
    names = kernel.forms
    lms = builds(recipe, kernel)
    lm = lms[names[0]]
    prompts = load_suite(str(ROOT / "bench/prompts/unseen.yaml"))[: args.num_prompts]
    items = [Prompt(p.id, p.kind, lm.encode(p.prompt, f"prompts.{p.id}")) for p in prompts]
    span = max(i.input_ids.shape[1] for i in items) + args.max_new_tokens
    for form in lms.values():
        form.warm_up(span)
    eos = sorted(lm.eos_token_ids(gen))
    runners = {f: ours_runner(lms[f], eos) for f in names}
    if args.ar_step:  # each form's plain AR on the same target object, interleaved with the rest: its decode step
        ar = recipe.replace(draft=None, spec=SpeculationSpec(drafter="none"))
        for f in names:
            twin = build(ar, target=lms[f].target, tokenizer=lms[f].tokenizer)
            twin.warm_up(span)
            runners[f"{f}_ar"] = ours_runner(twin, eos)
    measured = measure(runners, items, gen, repeats=args.repeats, warmup=1, rotate=True, desc=name,
                       before_repetition=lambda rep: [m.forget() for m in lms.values()])
    fresh = fresh_curves(lms, names, args.curve_repeats)
    forms = {}
    for f in names:
        calls = [c.stats for i in range(len(items)) for c in measured.per_prompt(f, i)]
        curve = [round(x, 1) for x in lms[f].verify_cost_for(16).step_ms[:16]]
        draft_ms, verify_ms = (statistics.median(getattr(s, k) / s.rounds for s in calls)
                               for k in ("draft_ms", "target_ms"))
        step_ms = fresh[f][0]  # a one-token step: the AR twin's median step where measured, else the fresh curve's
        if args.ar_step:
            step_ms = statistics.median(c.stats.target_ms / c.stats.rounds for i in range(len(items))
                                        for c in measured.per_prompt(f"{f}_ar", i))
        forms[f] = {"tok_s": measured.speed(f)["throughput"]["median"], "tau": measured.tau(f),
                    "ttft_ms": statistics.median(s.ttft_ms for s in calls),
                    "width": statistics.median(s.verify_tokens / s.rounds for s in calls),
                    "draft_ms_per_round": round(draft_ms, 1), "verify_ms_per_round": round(verify_ms, 1),
                    "step_ms": round(step_ms, 1), "round_in_steps": round((draft_ms + verify_ms) / step_ms, 2),
                    "curve_ms": curve, "fresh_curve_ms": fresh[f], "path": lms[f].engine_note}
    prompt_s = prompt_forwards(lms, names, args.prompt_lengths)
    same, margins = [], []
    for i, item in enumerate(items):  # where the texts part: the default kernel's top-2 margin there (near-tie?)
        ours, theirs = (measured.per_prompt(f, i)[-1].token_ids for f in names)
        same.append(ours == theirs)
        divergence = first_divergence(lms[names[1]].target, item.input_ids, theirs, ours)
        margins.append(divergence["margin"] if divergence else None)
    return {"recipe": name, "weights": recipe.target.precision, "forms": forms, "same_text": same,
            "ratio": measured.paired_ratio(*names), "prompt_forward_s": prompt_s, "divergence_margins": margins}


def fresh_curves(lms: dict, forms: tuple[str, str], repeats: int, widths: int = 8) -> dict:
    """Each form's verify cost curve (ms, widths 1..``widths``) measured again after the timed calls, the forms
    alternating ``repeats`` times, median per width (:func:`toolkit.engine.cost.measure_verify_cost` on each form's
    own engine): the one-token step a round is counted in, measured side by side."""
    runs: dict[str, list[list[float]]] = {f: [] for f in forms}
    for _ in range(repeats):
        for f in forms:
            runs[f].append(measure_verify_cost(lms[f].target, widths, forward=lms[f].engine).step_ms[:widths])
    return {f: [round(statistics.median(r[w] for r in runs[f]), 1) for w in range(widths)] for f in forms}


def prompt_forwards(lms: dict, forms: tuple[str, str], lengths: list[int], repeats: int = 3) -> dict:
    """Seconds of the target's forward over a prompt of each length (random ids, logits of the last position: what a
    prefill computes), per form, forms interleaved, median of ``repeats``."""
    out = {}
    for length in lengths:
        ids = torch.randint(100, 10_000, (1, length), generator=torch.Generator().manual_seed(length))
        times: dict[str, list[float]] = {f: [] for f in forms}
        for _ in range(repeats):
            for f in forms:
                start = time.perf_counter()
                with torch.inference_mode():
                    lms[f].target(ids, logits_to_keep=1)
                times[f].append(time.perf_counter() - start)
        out[str(length)] = {f: round(statistics.median(v), 3) for f, v in times.items()}
    return out


def parted(r: dict) -> str:
    margins = [m for m in r.get("divergence_margins", []) if m is not None]
    return f" ({max(margins):.3f})" if margins else ""


def markdown(report: dict) -> str:
    kernel = KERNELS[report["kernel"]]
    first, second = kernel.forms
    lines = [f"# {kernel.title}", "",
             f"CPU: {cpu_line(report['cpu'])}; torch {report['environment'].get('torch', '?')}. Two builds of the same "
             f"weights in one process, interleaved, median of {report['repeats']} repetitions, "
             f"{report['max_new_tokens']} new tokens, tok/s including the prompt; prompts: bench/prompts/unseen.yaml"
             + (f"; K = {report['num_draft_tokens']} for every recipe" if report.get("num_draft_tokens") else "")
             + ("; step ms = each form's plain AR on the same target, interleaved (median target ms a token)."
                if report.get("ar_step") else "; step ms = the re-measured curve's width 1."),
             "", "| recipe | form | verify ms, widths 1 / 2 / 4 / 8 / 16 | draft + verify ms a round (÷ step ms) "
             "| TTFT ms | width/round | τ | tok/s | ratio | same text (largest top-2 margin where they part) |",
             "|---" * 10 + "|"]
    for r in report["recipes"]:
        for f in kernel.forms:
            x, c = r["forms"][f], r["forms"][f]["curve_ms"]
            ratio = f"**{r['ratio']:.2f}x**" if f == first else "1.00x"
            lines.append(f"| {r['recipe']} | {f.replace('_', ' ')} | {c[0]} / {c[1]} / {c[3]} / {c[7]} / {c[15]} | "
                         f"{x['draft_ms_per_round']} + {x['verify_ms_per_round']} "
                         f"(÷ {x['step_ms']} = {x['round_in_steps']:.2f}) | "
                         f"{x['ttft_ms']:.0f} | {x['width']:.1f} | {x['tau']:.2f} | {x['tok_s']:.1f} | {ratio} | "
                         f"{sum(r['same_text'])}/{len(r['same_text'])}{parted(r)} |")
    lines += ["", "Each form's verify cost curve measured again after the timed calls, the forms alternating, median "
              "(ms, widths 1-8; without --ar-step a round's step above is width 1 here):", "",
              "| recipe | form | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |", "|---" * 10 + "|"]
    lines += [f"| {r['recipe']} | {f.replace('_', ' ')} | " + " | ".join(map(str, r["forms"][f]["fresh_curve_ms"]))
              + " |" for r in report["recipes"] for f in kernel.forms]
    prompts = [(r["recipe"], n, t) for r in report["recipes"] for n, t in r["prompt_forward_s"].items()]
    if prompts:
        lines += ["", "The target's forward over a prompt (random ids, last position's logits; median of 3, "
                  "interleaved):", "", f"| recipe | prompt tokens | {first.replace('_', ' ')} s | "
                  f"{second.replace('_', ' ')} s | ratio |", "|---" * 5 + "|"]
        lines += [f"| {name} | {n} | {t[first]:.2f} | {t[second]:.2f} | **{t[second] / t[first]:.1f}x** |"
                  for name, n, t in prompts]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), required=True)
    parser.add_argument("--recipes", nargs="+", help="default: the kernel's recipes")
    parser.add_argument("--num-draft-tokens", type=int, help="override every recipe's spec.num_draft_tokens (K)")
    parser.add_argument("--ar-step", action="store_true",
                        help="also time each form's plain AR on the same target, interleaved: a round in its steps")
    parser.add_argument("--curve-repeats", type=int, default=3,
                        help="re-measure each form's verify cost curve this often after the timed calls")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-lengths", type=int, nargs="*", default=[300, 1000],
                        help="also time the target's forward over prompts of these lengths, both forms")
    parser.add_argument("--out", type=Path, help="default: bench/reports/<kernel>")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = KERNELS[args.kernel]
    why_not = kernel.applies()
    if why_not:
        sys.exit(why_not)
    report = {"kernel": args.kernel, "cpu": cpu_isa(), "environment": environment(), "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens, "ar_step": args.ar_step,
              "recipes": []}
    for name in args.recipes or kernel.recipes:
        report["recipes"].append(one_recipe(name, kernel, args))
    out = args.out or ROOT / "bench/reports" / args.kernel
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "dense_kernels.json", report)
    atomic_write_text(out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
