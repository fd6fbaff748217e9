"""Stage ``kivi_device``: why the KIVI-quantized cache gave other greedy tokens on the GPU than on the CPU (the first
kit: from token 13, random weights, fp32), settled by three measurements:

1. **the quantizer alone**: the same tensors (random, copied bit for bit to both devices) quantized by
   :func:`toolkit.kv.quant_pack.quantize` on the device and on the CPU, at 2 and 4 bits, groups of 8 / 32 / 64,
   keys per channel and values per token; the packed codes, scales and zero points compared byte for byte. Equal
   bytes mean the quantizer is device-independent and the difference comes from its inputs.
2. **its inputs**: one prefill of the same prompt through the same fp32 weights on both devices; per layer the
   largest |Δ| between the devices' keys and values, and how many packed bytes differ once each device quantizes
   its own (4-bit, groups of 8, the policy's setting in the first kit): tiny key differences move values across a
   rounding boundary.
3. **fp32 identity of KIVI between devices**: greedy tokens with the quantized cache on the device and on the CPU
   (the kit's ``check`` shape, peaked logits, and the real embedded model when relayed), the first divergence and
   the fp32 top-2 margin of the CPU's plain (unquantized) forward there.

In the dry run both "devices" are the CPU: every comparison is exact by construction; the stage runs end to end.
"""

from __future__ import annotations

import copy

import torch

from gpu_kit import shapes
from gpu_kit.checks import compare, ours
from toolkit.kv import make_policy
from toolkit.kv.quant_pack import quantize
from toolkit.recipe import KVSpec
from toolkit.speculative.drafters import LookupDrafter

#: (bits, group) pairs of the quantizer comparison
SETTINGS = [(4, 8), (4, 32), (4, 64), (2, 8), (2, 32), (2, 64)]


def differing_bytes(a, b) -> dict:
    """``{"data", "scale", "zero"}``: how many elements of two :class:`~toolkit.kv.quant_pack.Packed` differ (bit
    patterns, compared on the CPU), and ``"total"`` elements of each."""
    out = {}
    for name in ("data", "scale", "zero"):
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        if x.dtype.is_floating_point:
            x, y = x.view(torch.int16), y.view(torch.int16)
        out[name] = int((x != y).sum())
        out[f"{name}_total"] = x.numel()
    return out


def _both_axes(x: torch.Tensor, bits: int, group: int) -> dict:
    """Packed keys (per channel: the token axis quantized, ``x`` transposed) and values (per token) of ``x``
    ``(B, heads, tokens, head_dim)``."""
    return {"keys per channel": quantize(x.transpose(-1, -2), bits, group),
            "values per token": quantize(x, bits, group)}


def quantizer_alone(device: torch.device, seed: int = 0) -> list[dict]:
    """Measurement 1 (see the module docstring): rows ``{bits, group, axis, data, scale, zero, ...}``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 8, 256, 64, generator=gen) * torch.rand(1, 8, 1, 64, generator=gen) * 4
    rows = []
    for bits, group in SETTINGS:
        cpu, dev = _both_axes(x, bits, group), _both_axes(x.to(device), bits, group)
        for axis in cpu:
            rows.append({"bits": bits, "group": group, "axis": axis, **differing_bytes(cpu[axis], dev[axis])})
    return rows


def _prefill_kv(model, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        cache = model(input_ids=prompt.to(model.device), use_cache=True).past_key_values
    return [(layer.keys.float().cpu(), layer.values.float().cpu()) for layer in cache.layers]


def kv_inputs(device_model, cpu_model, prompt: torch.Tensor, bits: int = 4, group: int = 8) -> list[dict]:
    """Measurement 2: per layer, max |Δ| of keys and values between the devices and the packed bytes that differ
    when each device quantizes its own (``bits``, ``group``)."""
    rows = []
    for i, ((kd, vd), (kc, vc)) in enumerate(zip(_prefill_kv(device_model, prompt), _prefill_kv(cpu_model, prompt))):
        tokens = kd.shape[-2] // group * group
        kd, vd, kc, vc = (t[..., :tokens, :] for t in (kd, vd, kc, vc))
        keys = differing_bytes(quantize(kd.transpose(-1, -2), bits, group), quantize(kc.transpose(-1, -2), bits, group))
        values = differing_bytes(quantize(vd, bits, group), quantize(vc, bits, group))
        rows.append({"layer": i, "max_abs_diff_keys": float((kd - kc).abs().max()),
                     "max_abs_diff_values": float((vd - vc).abs().max()), "key_codes_differing": keys["data"],
                     "value_codes_differing": values["data"], "codes_total": keys["data_total"] + values["data_total"]})
    return rows


def _margin_at(model, prompt: torch.Tensor, prefix: list[int]) -> float:
    """fp32 top-2 margin of ``model``'s plain forward after ``prompt`` + ``prefix`` (on the CPU)."""
    ids = torch.cat([prompt, torch.tensor([prefix], dtype=prompt.dtype)], 1) if prefix else prompt
    with torch.no_grad():
        top = model(input_ids=ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def kivi_identity(device_model, cpu_model, prompt: torch.Tensor, new: int, bits: int) -> dict:
    """Measurement 3 for one model: greedy tokens with the KIVI cache (``bits``, groups of 8, residual 8, 4 sinks)
    on both devices, the first divergence and the CPU's plain fp32 top-2 margin there."""
    params = {"quant_bits": bits, "quant_group_size": 8, "residual_length": 8, "sink_tokens": 4}
    on_device, stats = ours(device_model, LookupDrafter(max_cached_requests=0), prompt.to(device_model.device), new,
                            policy=make_policy(KVSpec("quantized", params)))
    on_cpu, _ = ours(cpu_model, LookupDrafter(max_cached_requests=0), prompt, new,
                     policy=make_policy(KVSpec("quantized", params)))
    row = {"bits": bits, **compare(on_device, on_cpu), "compressions": stats.compressions_target}
    if row["first_divergence"] is not None:
        row["cpu_margin_at_divergence"] = _margin_at(cpu_model, prompt, on_cpu[:row["first_divergence"]])
    return row


def kivi_device(kit) -> dict:
    """The three measurements (module docstring); ``quantizer_device_independent``: measurement 1 found no byte
    differing."""
    out = {"device": str(kit.device), "quantizer": quantizer_alone(kit.device)}
    out["quantizer_device_independent"] = all(r["data"] == r["scale"] == r["zero"] == 0 for r in out["quantizer"])
    kit.partial("kivi_device", out)
    device_model = kit.model("tiny" if kit.dry_run else "check", torch.float32)
    cpu_model = copy.deepcopy(device_model).to("cpu")
    prompt = shapes.prompts(kit.tokenizer, 1, kit.prompt_tokens)[0]
    out["inputs"] = kv_inputs(device_model, cpu_model, prompt)
    new = kit.new_tokens if kit.dry_run else 64
    out["identity"] = [{"model": "random (check shape)" if not kit.dry_run else "random (tiny)",
                        **kivi_identity(device_model, cpu_model, prompt, new, bits)} for bits in (4, 2)]
    kit.partial("kivi_device", out)
    real = None if kit.dry_run else kit.embedded
    if real is not None:
        model, tok = real
        cpu_real = copy.deepcopy(model).to("cpu")
        real_prompt = shapes.prompts(tok, 1, kit.prompt_tokens)[0]
        out["inputs_real"] = kv_inputs(model, cpu_real, real_prompt)
        out["identity"] += [{"model": "embedded SmolLM2 (real weights)",
                             **kivi_identity(model, cpu_real, real_prompt, new, bits)} for bits in (4, 2)]
        del cpu_real
    return out
