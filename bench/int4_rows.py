"""What a verify forward's width costs in the 4-bit kernel: every linear layer of the embedded model at ``precision:
native`` (the GGUF's own Q4_1 blocks; the tied LM head from the Q8_0 embedding, two 4-bit planes) timed alone at 1..8
input rows, and the sum over one forward.

    PYTHONPATH=. .venv/bin/python bench/int4_rows.py [--rows 8] [--repeats 7] [--out bench/reports/int4-rows]

Why: a speculative round verifies ``K + 1`` tokens in one forward, and the round pays only if that forward costs
little more than a one-token step. ATen's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, under torchao's int4 and
:class:`toolkit.quant.int4_linear.PackedInt4Linear`) dequantizes the weights again for every block of 4 input rows,
so its cost grows with the rows inside a block and jumps at the fifth. This bench measures that curve per layer shape
on the machine it runs on (state ``lscpu``'s flags with it: AVX2-only and AVX-512 CPUs differ), next to the same
products as dense bf16 and fp32 GEMMs over the dequantized weight (what a kernel without re-dequantization would
read: 4x and 8x the bytes).

A layer alone: the median of ``--repeats`` batches of calls (its weights warm in the caches where they fit). One
forward's layers: the median of ``--repeats`` forwards, every kernel and row count in turn per repetition. torch's
default threads, nothing else running. Writes ``<out>/int4_rows.json`` and ``<out>/README.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.cpu import cpu_line  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.timing import time_ms  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.quant.int4_linear import PackedInt4Linear  # noqa: E402
from toolkit.recipe import ModelSpec  # noqa: E402


def time_us(fn, repeats: int, budget_s: float = 0.05) -> float:
    """Median microseconds of one ``fn()`` call: :func:`toolkit.measure.timing.time_ms` over ``repeats`` batches of
    calls (batch size chosen so a batch takes about ``budget_s``: a single call of a small layer is a few tens of us,
    near the clock's own cost), after warm-up batches for the caches and the allocator."""
    began = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / max(time.perf_counter() - began, 1e-6)))
    summary, _ = time_ms(lambda: [fn() for _ in range(calls)], repeats=repeats, warmup=2)
    return summary.median * 1000 / calls


def layer_kinds(model) -> dict[tuple, dict]:
    """``{(out_features, in_features, planes): {"count", "names", "module"}}`` over the model's 4-bit layers."""
    kinds: dict[tuple, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedInt4Linear):
            key = (module.out_features, module.in_features, module.planes)
            entry = kinds.setdefault(key, {"count": 0, "names": [], "module": module})
            entry["count"] += 1
            if len(entry["names"]) < 2:
                entry["names"].append(name)
    return kinds


@torch.inference_mode()
def measure(kinds: dict, rows: int, repeats: int) -> list[dict]:
    """Per layer kind, its 4-bit module's forward alone (weights warm in the caches where they fit), in
    microseconds, at 1..``rows`` input rows."""
    out = []
    for (n, k, planes), entry in sorted(kinds.items(), key=lambda item: -item[0][0] * item[0][1]):
        module = entry["module"]
        row = {"shape": [n, k], "planes": planes, "count": entry["count"], "example": entry["names"], "int4_us": []}
        for m in range(1, rows + 1):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            row["int4_us"].append(time_us(lambda: module(x), repeats))
        out.append(row)
        print(f"{n}x{k} (planes {planes}, x{entry['count']}): int4 "
              + " ".join(f"{t:.0f}" for t in row["int4_us"]) + " us", flush=True)
    return out


@torch.inference_mode()
def per_forward(model, rows: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of every 4-bit layer of one forward run in model order, each on its own weights (streamed from
    memory as in a real forward), by input rows: ``{"int4", "bf16", "fp32"}`` (the last two: dense GEMMs over the
    dequantized weights, what a kernel without re-dequantization would read). The kernels and row counts are timed
    interleaved, one forward of each per repetition in turn, so drift of the machine spreads over all of them."""
    modules = [m for m in model.modules() if isinstance(m, PackedInt4Linear)]
    weights = {"bf16": [m.dense_weight() for m in modules]}
    weights["fp32"] = [w.float() for w in weights["bf16"]]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    calls = {}
    for m in range(1, rows + 1):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {mod.in_features for mod in modules}}
        calls["int4", m] = lambda xs=xs: [mod(xs[mod.in_features]) for mod in modules]
        for key, dtype in dtypes.items():
            xd = {k: x.to(dtype) for k, x in xs.items()}
            calls[key, m] = lambda ws=weights[key], xd=xd: [torch.nn.functional.linear(xd[w.shape[1]], w) for w in ws]
    for fn in calls.values():  # warm: allocator, first-touch of the dense copies
        fn()
    samples: dict = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            began = time.perf_counter()
            fn()
            samples[key].append((time.perf_counter() - began) * 1000)
    out = {kind: [statistics.median(samples[kind, m]) for m in range(1, rows + 1)] for kind in ("int4", *dtypes)}
    print("one forward's layers (ms): " + "; ".join(f"{k} " + " ".join(f"{t:.1f}" for t in v) for k, v in out.items()))
    return out


def markdown(report: dict) -> str:
    layers, rows = report["layers"], report["rows"]
    widths = " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in range(1, rows + 1))
    head = f"| layer (out x in) | planes | in one forward | {widths} |"
    lines = [f"# Verify width in the 4-bit kernel: {report['model']}", "",
             f"{report['cpu']}; torch {report['torch']}, {report['threads']} threads. Each layer alone, median of "
             f"{report['repeats']} batches of calls; us per call (x one row), weights warm in the caches where they "
             f"fit. Command: `{report['command']}`.", "",
             head, "|" + "---|" * (rows + 3)]
    for layer in layers:
        base = layer["int4_us"][0]
        cells = " | ".join(f"{t:.0f} ({t / base:.2f}x)" for t in layer["int4_us"])
        lines.append(f"| {layer['shape'][0]} x {layer['shape'][1]} ({', '.join(layer['example'])}) | "
                     f"{layer['planes']} | {layer['count']} | {cells} |")
    lines += ["", "One forward's 4-bit layers in model order, each on its own weights (streamed as in a real forward), "
              "ms (x one row); and the same products as dense GEMMs over the dequantized weights:", "",
              f"| kernel | {widths} |", "|" + "---|" * (rows + 1)]
    for key, label in (("int4", "ATen int4 (the engine's)"), ("bf16", "dense bf16"), ("fp32", "dense fp32")):
        total = report["per_forward_ms"][key]
        lines.append(f"| {label} | " + " | ".join(f"{t:.2f} ({t / total[0]:.2f}x)" for t in total) + " |")
    head_share = report["head_share"]
    lines += ["", f"The LM head's share of the 4-bit layers' time (alone): {head_share[0]:.0%} at one row"
              + (f", {head_share[3]:.0%} at 4 rows." if rows >= 4 else ".")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="widest forward timed (input rows), 1..64")
    parser.add_argument("--repeats", type=int, default=7,
                        help="repetitions per timing (median): batches of calls for a layer alone, forwards for one "
                             "forward's layers")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "reports" / "int4-rows")
    args = parser.parse_args()
    if not 1 <= args.rows <= 64:
        parser.error(f"--rows: {args.rows} is not in 1..64")
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} is not >= 1")
    model, _ = load_model(ModelSpec(source="embedded", precision="native"))
    kinds = layer_kinds(model)
    if not kinds:
        raise SystemExit("the embedded model at precision native has no 4-bit layers: nothing to time")
    layers = measure(kinds, args.rows, args.repeats)
    totals = per_forward(model, args.rows, args.repeats)
    alone = [sum(layer["int4_us"][m] * layer["count"] for layer in layers) for m in range(args.rows)]
    vocab = max(layer["shape"][0] for layer in layers)
    head = next(layer for layer in layers if layer["shape"][0] == vocab)
    share = [head["int4_us"][m] * head["count"] / alone[m] for m in range(args.rows)]
    report = {"model": "embedded SmolLM2-135M-Instruct, precision native (Q4_1 layers, Q8_0 tied head)",
              "cpu": cpu_line(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": args.rows, "repeats": args.repeats, "command": " ".join(["bench/int4_rows.py", *sys.argv[1:]]),
              "layers": layers, "per_forward_ms": totals, "head_share": share}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "int4_rows.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
