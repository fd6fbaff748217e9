"""Stage ``weights``: quantized weights on the GPU, timed on CUDA graphs, against HF on the **same quantized weights**.

Per shape (the 8B and 1B shapes on a GPU, random weights, bf16 activations; ``tiny`` in the dry run) and per weight
format of :data:`FORMATS`:

* ``ours AR`` and ``ours lookup`` (cost-aware K) on the compiled static engine (CUDA graphs on a GPU);
* ``HF static compiled AR``: HF ``generate`` with the static cache and ``torch.compile`` (``reduce-overhead``) on the
  same model object, so on the same quantized weights (its first call, the compile, timed apart);
* the linear layers alone at one token (:func:`gpu_kit.linear_probe.linear_probe`: kernel ms per token, apart
  from the decoder around them);
* weight bytes, bytes read per decoded token (:func:`toolkit.models.sizes.bytes_read_per_token`: every weight
  once, one embedding row) plus the KV cache a step attends to, and the fraction of the device's peak memory bandwidth
  (:data:`PEAK_BANDWIDTH`) a step of ours reaches: ``bytes per token x tok/s / peak``.

Formats: the toolkit's own torchao paths (:func:`toolkit.quant.torchao.quantize`: int4 = tinygemm's
``tile_packed_to_4d`` layout, int8 weight-only), torchao float8 (weight-only and dynamic per-row activations; sm89+),
torchao int4 ``preshuffled`` (the fastest Hopper layout, which needs the ``mslk`` kernels: skipped with that reason
where they are missing), and bitsandbytes NF4 / LLM.int8() modules built from the same bf16 weights
(:func:`bnb_quantize`; the LM head stays bf16, as transformers' ``BitsAndBytesConfig`` leaves it). A format that
cannot run here is a row with its reason; one that fails is a row with its error: the next one runs.

Order: the 8B shape's bf16 and int4 first (the GPU issue's targets), then the 1B shape in every format, then the rest
of the 8B shape, until the budget is spent.
"""

from __future__ import annotations

import gc
import time

import torch

from gpu_kit import shapes
from gpu_kit.checks import ours
from gpu_kit.linear_probe import linear_probe
from gpu_kit.speed import hf_static_compiled
from toolkit.engine.planner import CostAwareK
from toolkit.measure.timing import synchronize, time_ms
from toolkit.models.sizes import bytes_read_per_token, weight_bytes
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import LookupDrafter
from toolkit.speculative.verify_length import Calibrator

#: bytes/s of HBM by device name fragment (vendor datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB 2.04 TB/s)
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}
FORMATS = ("bf16", "torchao int4 (tile_packed_to_4d)", "torchao int4 (preshuffled)", "torchao int8 weight-only",
           "torchao float8 weight-only", "torchao float8 dynamic (per-row)", "bitsandbytes NF4",
           "bitsandbytes int8 (LLM.int8())")


class Unavailable(Exception):
    """A format that cannot run on this machine (the message says why)."""


def _group(model, wanted: int = 128) -> int:
    """The largest torchao int4 group size <= ``wanted`` dividing every linear input width."""
    widths = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return next(g for g in (wanted, 64, 32) if all(w % g == 0 for w in widths))


def _torchao_toolkit(model, precision: str, device: torch.device, **fields) -> str:
    from toolkit.models.spec import ModelSpec
    from toolkit.quant import torchao as ours_torchao

    spec = ModelSpec(source="embedded", precision=precision, backend="torchao", torchao_compute_dtype="bf16", **fields)
    ours_torchao.quantize(model, spec, device, "target")
    return ours_torchao.kernel_path(spec, device)


def _float8(model, device: torch.device, dynamic: bool) -> str:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise Unavailable("torchao float8 needs a CUDA GPU of compute capability >= 8.9 (Ada / Hopper)")
    from toolkit.quant.torchao import import_quietly

    quantization = import_quietly("target")
    if dynamic:
        from torchao.quantization import PerRow

        config = quantization.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    else:
        config = quantization.Float8WeightOnlyConfig()
    quantization.quantize_(model, config, device=device)
    return f"torchao {type(config).__name__}: torch._scaled_mm (fp8 tensor cores)" if dynamic else \
        "torchao Float8WeightOnlyConfig: fp8 weights dequantized to bf16, then a bf16 matmul"


def _preshuffled(model, device: torch.device) -> str:
    import importlib.util

    if device.type != "cuda":
        raise Unavailable("the preshuffled int4 layout runs on CUDA only")
    if importlib.util.find_spec("mslk") is None:
        raise Unavailable("torchao's preshuffled int4 layout needs the mslk kernels (not on PyPI: pytorch.org's "
                          "index only, which this machine cannot reach)")
    from toolkit.quant.torchao import import_quietly

    quantization = import_quietly("target")
    quantization.quantize_(model, quantization.Int4WeightOnlyConfig(group_size=128,
                                                                    int4_packing_format="preshuffled"))
    return "torchao int4 preshuffled (mslk bf16i4bf16_rowwise, CUTLASS on Hopper)"


def bnb_quantize(model, kind: str, device: torch.device) -> str:
    """Replace every ``nn.Linear`` of ``model`` but the LM head with bitsandbytes' ``Linear4bit`` (``kind`` "nf4":
    NF4, bf16 compute, blocks of 64) or ``Linear8bitLt`` ("int8": LLM.int8(), outlier threshold 6.0), quantized
    from the same weights on ``device``. Returns the kernel line. Raises :class:`Unavailable` without bitsandbytes."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise Unavailable("bitsandbytes is neither installed nor carried (bench/gpu_carry.py)")
    from toolkit.quant.bitsandbytes import import_quietly, kernel_path

    bnb = import_quietly("target")
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or child is head:
                continue
            weight = child.weight.data.to("cpu")  # both Params classes quantize on their move to the device
            if kind == "nf4":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
                new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                          has_fp16_weights=False, threshold=6.0, device="meta")
                new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                new.bias = torch.nn.Parameter(child.bias.data.to("cpu"), requires_grad=False)
            setattr(parent, name, new.to(device))
    return kernel_path("int4" if kind == "nf4" else "int8", device)


def quantized(kit, shape: str, fmt: str):
    """``(model, kernel line)``: a fresh random-weight ``shape`` model in bf16 on the kit's device, quantized as
    ``fmt``. Raises :class:`Unavailable` where ``fmt`` cannot run here."""
    model = shapes.build(shape, kit.device, torch.bfloat16, seed=0)
    device = kit.device
    if fmt == "bf16":
        return model, "bf16 matmuls (cuBLAS on CUDA)"
    if fmt.startswith("torchao int4 (tile"):
        return model, _torchao_toolkit(model, "int4", device, torchao_group_size=_group(model))
    if fmt.startswith("torchao int4 (pre"):
        return model, _preshuffled(model, device)
    if fmt == "torchao int8 weight-only":
        return model, _torchao_toolkit(model, "int8", device, torchao_int8="weight_only")
    if fmt.startswith("torchao float8"):
        return model, _float8(model, device, dynamic="dynamic" in fmt)
    return model, bnb_quantize(model, "nf4" if "NF4" in fmt else "int8", device)


def _timed(kit, fn, repeats: int) -> tuple[list[float], object]:
    """tok/s of ``repeats`` calls of ``fn() -> (new ids, stats)`` after one untimed call (warm-up / compile)."""
    fn()
    rates, stats = [], None
    for _ in range(repeats):
        synchronize(kit.device)
        summary, (ids, stats) = time_ms(fn, kit.device, repeats=1, warmup=0)
        rates.append(len(ids) / (summary.median / 1000.0))
    return rates, stats


def _methods(kit, model, prompt, gen) -> dict:
    forward = kit.compiled(model) if kit.compile_backend != "none" else None
    cost = CostAwareK(VerifyCost([1.0] * 17, learn=False), Calibrator(), 16, 17)
    return {"ours AR": lambda: ours(model, None, prompt, gen.max_new_tokens, forward=forward),
            "ours lookup (cost-aware K)": lambda: ours(model, LookupDrafter(max_cached_requests=0), prompt,
                                                       gen.max_new_tokens, cost, forward=forward),
            "HF static compiled AR": lambda: (hf_static_compiled(model, prompt, gen, kit.compile_backend,
                                                                 kit.compile_mode), None)}


def measure(kit, shape: str, fmt: str) -> dict:
    """One (shape, format) row: kernel line, bytes, and per method tok/s (median, min, max), α / τ of ours, the
    fraction of peak bandwidth of ours, HF's first-call (compile) seconds."""
    began = time.perf_counter()
    model, kernel = quantized(kit, shape, fmt)
    row = {"kernel": kernel, "quantize_s": time.perf_counter() - began, "weight_bytes": weight_bytes(model),
           "bytes_read_per_token_weights": bytes_read_per_token(model), "methods": {}}
    prompt = shapes.prompts(kit.tokenizer, 1, kit.prompt_tokens)[0].to(kit.device)
    gen = GenerationSpec(max_new_tokens=kit.new_tokens, ignore_eos=True)
    config = model.config
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 2  # bf16 keys + values
    row["kv_bytes_per_step"] = kv_per_token * (kit.prompt_tokens + kit.new_tokens // 2)  # the mean context attended
    peak = _peak_bandwidth(kit)
    try:
        row["linear_probe"] = linear_probe(model)
    except Exception as exc:  # noqa: BLE001 - the probe failing must not stop the timed methods
        row["linear_probe"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        for method, fn in _methods(kit, model, prompt, gen).items():
            if kit.out_of_time(f"{method} on {shape} {fmt}"):
                break
            cell = row["methods"].setdefault(method, {})
            try:
                first, counts = time.perf_counter(), compile_counts()
                rates, stats = _timed(kit, fn, kit.timing_repeats)
                cell["compile"] = {k: v - counts[k] for k, v in compile_counts().items()}
                cell.update(tok_s=sorted(rates)[len(rates) // 2], tok_s_min=min(rates), tok_s_max=max(rates),
                            seconds=time.perf_counter() - first)
                if stats is not None:
                    cell.update(alpha=stats.acceptance_rate, tau=stats.tokens_per_round)
                if peak and method == "ours AR":
                    bytes_token = row["bytes_read_per_token_weights"] + row["kv_bytes_per_step"]
                    cell["bandwidth_fraction"] = bytes_token * cell["tok_s"] / peak
            except Exception as exc:  # noqa: BLE001 - one method failing must not stop the others
                cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        kit.forget(model)
        del model
        gc.collect()
        if kit.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def compile_counts() -> dict:
    """Dynamo's and inductor's running counts: graphs compiled, graph breaks, CUDA graph trees that declined a
    graph (their differences over a method say whether it ran as one captured graph; an int4 AR at 0.64x bf16 on an
    H100, 2026-11-27, came without them)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def _peak_bandwidth(kit) -> float | None:
    if kit.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(kit.device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def plan(kit) -> list[tuple[str, str]]:
    """(shape, format) in the stage's order (module docstring)."""
    if kit.dry_run:
        return [("tiny", fmt) for fmt in FORMATS]
    big, small = "llama-3.1-8b", "llama-3.2-1b"
    first = [(big, "bf16"), (big, "torchao int4 (tile_packed_to_4d)")]
    return first + [(small, f) for f in FORMATS] + [(big, f) for f in FORMATS if (big, f) not in first]


def weights(kit) -> dict:
    """Every (shape, format) of :func:`plan` in the time left; results saved after each row."""
    out = {"peak_bandwidth_bytes_s": _peak_bandwidth(kit), "new_tokens": kit.new_tokens,
           "prompt_tokens": kit.prompt_tokens, "shapes": {}}
    for shape, fmt in plan(kit):
        if kit.out_of_time(f"weights: {shape} {fmt}"):
            out["shapes"].setdefault(shape, {})[fmt] = {"skipped": "time budget spent"}
            continue
        try:
            row = measure(kit, shape, fmt)
        except Unavailable as exc:
            row = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a format failing must not stop the next
            row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        kit.log(f"weights {shape} {fmt}: " + (", ".join(
            f"{m} {c.get('tok_s', 0):.1f} tok/s" for m, c in row.get("methods", {}).items()) or str(row)))
        out["shapes"].setdefault(shape, {})[fmt] = row
        kit.partial("weights", out)
    return out
