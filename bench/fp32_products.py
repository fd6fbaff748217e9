"""Do bf16 recipes gain from multiplying in fp32 where the CPU has no BF16 instructions? A bf16 recipe with its dense
layers as :class:`toolkit.quant.fp32_products.Fp32ProductLinear` (what :func:`toolkit.models.load_model` now does on
such a CPU) against the same recipe on PyTorch's emulated bf16 kernel, two builds of the same weights in one process.

    PYTHONPATH=. .venv/bin/python bench/fp32_products.py [--recipes short-suffix] [--num-prompts 4]
        [--max-new-tokens 96] [--repeats 3] [--prompt-lengths 300 1000] [--out bench/reports/fp32-products]

Protocol (:func:`toolkit.measure.harness.measure`): both builds warmed up (graphs compiled, each one's verify cost
curve read or measured: the planner of each plans on its own curve), one warm-up call per form, then ``--repeats``
repetitions, the two forms interleaved per prompt with the order rotated, the drafter's memory cleared before each
repetition; tok/s = new tokens / wall time of the call, prompt included. Per recipe: each form's verify cost curve
(ms, widths 1-16), tok/s and TTFT (medians), the paired ratio, τ, verify width per round, whether the greedy texts
are equal (bf16: the two forms sum in another order, so texts may part at near-ties: where they part, the bf16
kernel's top-2 margin there, :func:`eval.fidelity.first_divergence`); and the target's forward over
prompts of ``--prompt-lengths`` tokens both ways.

On a CPU with BF16 instructions both builds are the same (nothing is changed there): the script says so and stops.
Writes ``<out>/fp32_products.json`` and ``<out>/README.md`` with ``lscpu``'s model name and AVX flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.fidelity import first_divergence  # noqa: E402
from eval.runners import ours_runner  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Prompt, environment, measure  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.quant import fp32_products  # noqa: E402
from toolkit.quant.int4_linear import native_bf16  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

FORMS = ("fp32_products", "bf16_kernel")


def builds(recipe: Recipe) -> dict:
    """The recipe built twice from the same weights: as loaded (fp32 products) and with its layers left on PyTorch's
    bf16 kernel (:func:`~toolkit.quant.fp32_products.use_fp32_products` seeing a CPU with BF16 instructions while
    loading)."""
    lms = {"fp32_products": build(recipe)}
    with mock.patch.object(fp32_products, "native_bf16", lambda: True):
        lms["bf16_kernel"] = build(recipe)
    return lms


def one_recipe(name: str, args) -> dict:
    """Recipe ``name`` in both forms, measured side by side."""
    recipe = Recipe.load(resolve(name, "", "--recipes"))
    gen = dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens)
    lms = builds(recipe)
    lm = lms["fp32_products"]
    prompts = load_suite(str(ROOT / "bench/prompts/unseen.yaml"))[: args.num_prompts]
    items = [Prompt(p.id, p.kind, lm.encode(p.prompt, f"prompts.{p.id}")) for p in prompts]
    for form in lms.values():
        form.warm_up(max(i.input_ids.shape[1] for i in items) + args.max_new_tokens)
    eos = sorted(lm.eos_token_ids(gen))
    measured = measure({f: ours_runner(lms[f], eos) for f in FORMS}, items, gen, repeats=args.repeats, warmup=1,
                       rotate=True, desc=name, before_repetition=lambda rep: [m.forget() for m in lms.values()])
    forms = {}
    for f in FORMS:
        calls = [c.stats for i in range(len(items)) for c in measured.per_prompt(f, i)]
        forms[f] = {"tok_s": measured.speed(f)["throughput"]["median"], "tau": measured.tau(f),
                    "ttft_ms": statistics.median(s.ttft_ms for s in calls),
                    "width": statistics.median(s.verify_tokens / s.rounds for s in calls),
                    "curve_ms": [round(x, 1) for x in lms[f].verify_cost_for(16).step_ms[:16]],
                    "path": lms[f].engine_note}
    prompt_s = prompt_forwards(lms, args.prompt_lengths)
    same, margins = [], []
    for i, item in enumerate(items):  # where the texts part: the bf16 kernel's top-2 margin there (near-tie or not)
        ours, theirs = (measured.per_prompt(f, i)[-1].token_ids for f in FORMS)
        same.append(ours == theirs)
        divergence = first_divergence(lms["bf16_kernel"].target, item.input_ids, theirs, ours)
        margins.append(divergence["margin"] if divergence else None)
    return {"recipe": name, "weights": recipe.target.precision, "forms": forms, "same_text": same,
            "fp32_products_vs_bf16_kernel": measured.paired_ratio(*FORMS), "prompt_forward_s": prompt_s,
            "divergence_margins": margins}


def prompt_forwards(lms: dict, lengths: list[int], repeats: int = 3) -> dict:
    """Seconds of the target's forward over a prompt of each length (random ids, logits of the last position: what a
    prefill computes), per form, forms interleaved, median of ``repeats``."""
    out = {}
    for length in lengths:
        ids = torch.randint(100, 10_000, (1, length), generator=torch.Generator().manual_seed(length))
        times: dict[str, list[float]] = {f: [] for f in FORMS}
        for _ in range(repeats):
            for f in FORMS:
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
    lines = ["# bf16 layers multiplying in fp32 against PyTorch's bf16 kernel, on a CPU without BF16 instructions", "",
             f"CPU: {cpu_line(report['cpu'])}; torch {report['environment'].get('torch', '?')}. Two builds of the same "
             f"weights in one process, interleaved, median of {report['repeats']} repetitions, "
             f"{report['max_new_tokens']} new tokens, tok/s including the prompt; prompts: bench/prompts/unseen.yaml.",
             "", "| recipe | form | verify ms, widths 1 / 2 / 4 / 8 / 16 | TTFT ms | width/round | τ | tok/s | ratio "
             "| same text (largest top-2 margin where they part) |", "|---" * 9 + "|"]
    for r in report["recipes"]:
        for f in FORMS:
            x, c = r["forms"][f], r["forms"][f]["curve_ms"]
            ratio = f"**{r['fp32_products_vs_bf16_kernel']:.2f}x**" if f == FORMS[0] else "1.00x"
            lines.append(f"| {r['recipe']} | {f.replace('_', ' ')} | {c[0]} / {c[1]} / {c[3]} / {c[7]} / {c[15]} | "
                         f"{x['ttft_ms']:.0f} | {x['width']:.1f} | {x['tau']:.2f} | {x['tok_s']:.1f} | {ratio} | "
                         f"{sum(r['same_text'])}/{len(r['same_text'])}{parted(r)} |")
    prompts = [(r["recipe"], n, t) for r in report["recipes"] for n, t in r["prompt_forward_s"].items()]
    if prompts:
        lines += ["", "The target's forward over a prompt (random ids, last position's logits; median of 3, "
                  "interleaved):", "", "| recipe | prompt tokens | fp32 products s | bf16 kernel s | ratio |",
                  "|---" * 5 + "|"]
        lines += [f"| {name} | {n} | {t['fp32_products']:.2f} | {t['bf16_kernel']:.2f} | "
                  f"**{t['bf16_kernel'] / t['fp32_products']:.1f}x** |" for name, n, t in prompts]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["short-suffix"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-lengths", type=int, nargs="*", default=[300, 1000],
                        help="also time the target's forward over prompts of these lengths, both forms")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/fp32-products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_bf16():
        sys.exit("this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): bf16 layers keep PyTorch's kernel, "
                 "there is nothing to compare")
    report = {"cpu": cpu_isa(), "environment": environment(), "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "recipes": []}
    for name in args.recipes:
        report["recipes"].append(one_recipe(name, args))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "fp32_products.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
