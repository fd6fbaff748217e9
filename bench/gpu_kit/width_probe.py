"""Stage ``width_probe``: does a verify forward over W tokens pick the same argmax as the one-token step, and when it
does not, is the top-2 margin within bf16 rounding?

The first kit found our lookup's tokens equal to our AR's on 8 of 8 real requests in fp32 but on 1 of 8 in bf16
(``bench/reports/gpu``): a verify over n tokens runs other kernels (other reduction orders) than a one-token step,
so a near-tied argmax may flip. This stage measures that directly, on the compiled engine the decoder uses (CUDA
graphs on a GPU, widths padded to the engine's buckets):

1. our AR decodes ``new`` tokens (width-1 steps) on the engine: the reference sequence ``y``;
2. teacher-forced on ``y``, at every position ``t`` one forward per width ``W`` of the probe's widths (widest
   first, the width-1 step last, whose entries stay in the cache: the cache always holds what AR wrote) over the
   last committed token and the next ``W - 1`` tokens of ``y`` (drafts that agree with AR, as a perfect drafter's);
3. every position ``j`` of a W-wide forward whose argmax is not ``y``'s token there is a **flip**, reported with
   the one-token step's top-2 margin at that position (logit units), that margin in bf16 ulps of the top logit, and
   whether it is within bf16 rounding (:data:`ROUNDING_ULPS` ulps); per width, the largest |Δ logit| between the
   W-wide forward's first position and the width-1 step at the same position (same context, same query: the kernels'
   difference alone).

A flip at a margin above bf16 rounding is a bug (a mask, a position or a cache slot that differs), not numerics.
"""

from __future__ import annotations

import copy
import math

import torch

from gpu_kit import shapes
from gpu_kit.checks import ours
from toolkit.kv.static import capacity_for

#: a flip is "within bf16 rounding" when the one-token step's top-2 margin is at most this many bf16 ulps of the top
#: logit: each of the two logits carries up to half an ulp of output rounding, and a kernel with another reduction
#: order may move each by as much again
ROUNDING_ULPS = 2.0


def bf16_ulp(value: float) -> float:
    """One bf16 ulp (unit in the last place: 8 significand bits) at ``value``'s magnitude; 0 for 0."""
    if value == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def _top2(logits: torch.Tensor) -> tuple[float, float]:
    top = logits.float().topk(2).values
    return float(top[0]), float(top[0] - top[1])


def probe(forward, prompt: torch.Tensor, new: int, widths: list[int]) -> dict:
    """The probe on one prompt ``(1, n)`` (see the module docstring); ``widths`` include 1. Returns ``{"flips":
    [...], "positions", "forwards", "max_abs_diff": {W: logit units}, "ar_selfcheck"}`` (``ar_selfcheck``: the
    teacher-forced width-1 argmax equals our AR's token at every position)."""
    model = forward.model
    ar, _ = ours(model, None, prompt, new, forward=forward)
    seq = torch.cat([prompt[0], torch.tensor(ar, device=prompt.device)])
    start = prompt.shape[1] - 1  # the last prompt token: the first "last committed token"
    widths = sorted(set(widths), reverse=True)
    widest = forward.width_for(widths[0])
    cache = forward.cache_for(None, 1, capacity_for(len(seq) + widest), widest, keep=False)
    positions = len(ar) - 1
    margin1, top1, argmax1, candidates = [], [], [], []
    diffs = {w: 0.0 for w in widths if w > 1}
    one = torch.ones(1, dtype=torch.long, device=prompt.device)
    with torch.no_grad(), forward.attached():
        prefilled, kwargs = cache.begin_row(start)
        forward.prefill(prompt[:, :start], kwargs)
        cache.add_row(prefilled, start)
        for t in range(positions):
            pos = start + t
            first = {}
            for w in widths:
                w_eff = min(w, len(seq) - pos)
                logits = forward(cache, seq[pos:pos + w_eff].view(1, -1))[0].float()
                first[w] = logits[0]
                if w > 1:  # positions whose argmax is not y's token: flip candidates (margins filled in below)
                    want = seq[pos + 1:pos + 1 + w_eff]
                    got = logits.argmax(-1)[:len(want)]
                    for j in (got != want).nonzero().flatten().tolist():
                        candidates.append((t, w, j, int(got[j]), int(want[j]),
                                           float(logits[j, got[j]] - logits[j, want[j]])))
            top, margin = _top2(first[1])
            top1.append(top)
            margin1.append(margin)
            argmax1.append(int(first[1].argmax()))
            for w in diffs:
                diffs[w] = max(diffs[w], float((first[w] - first[1]).abs().max()))
            cache.accept(one, [1])
    selfcheck = argmax1 == seq[start + 1:start + 1 + positions].tolist()
    flips = []
    for t, w, j, token, want, gap in candidates:
        if t + j >= positions:
            continue
        margin, top = margin1[t + j], top1[t + j]
        ulps = margin / bf16_ulp(top) if top else math.inf
        flips.append({"position": t + j, "width": w, "runs_as": forward.width_for(w), "offset": j,
                      "ar_token": want, "wide_token": token, "margin": margin, "margin_ulps": ulps,
                      "wide_gap": gap, "within_bf16_rounding": ulps <= ROUNDING_ULPS})
    return {"flips": flips, "positions": positions, "forwards": positions * len(widths),
            "max_abs_diff": diffs, "min_margin": min(margin1) if margin1 else None, "ar_selfcheck": selfcheck}


def _models(kit) -> list[tuple[str, object, torch.dtype]]:
    """``(label, model, dtype)`` probed: the real embedded model in bf16 and fp32 when relayed (not in the dry run),
    and a random shape (the 1B shape on a GPU, ``tiny`` in the dry run) in bf16."""
    out = []
    real = None if kit.dry_run else kit.embedded
    if real is not None:
        out += [("embedded SmolLM2 (real weights), bf16", copy.deepcopy(real[0]).to(torch.bfloat16), torch.bfloat16),
                ("embedded SmolLM2 (real weights), fp32", real[0], torch.float32)]
    shape = "tiny" if kit.dry_run else kit.speed_shapes[0]
    out.append((f"{shape} (random weights), bf16", kit.model(shape, torch.bfloat16), torch.bfloat16))
    if kit.dry_run:
        out.append((f"{shape} (random weights), fp32", kit.model(shape, torch.float32), torch.float32))
    return out


def width_probe(kit) -> dict:
    """The probe per model (see :func:`_models`) over the kit's prompts; flips are listed with their margins.
    ``all_within_rounding`` is the GPU issue's target: every flip within bf16 rounding (fp32: no flip at all)."""
    widths = [1, 2, 4, 8, 16] if kit.device.type == "cuda" else [1, 2, 3, 4]
    new = 64 if not kit.dry_run else kit.new_tokens
    out = {"widths": widths, "new_tokens": new, "rounding_ulps": ROUNDING_ULPS, "models": {}}
    real = None if kit.dry_run else kit.embedded
    for label, model, dtype in _models(kit):
        if kit.out_of_time(f"width probe of {label}"):
            break
        forward = kit.compiled(model) if kit.compile_backend != "none" else None
        if forward is None:
            from toolkit.engine.forward import TargetForward

            forward = TargetForward(model)
        tok = real[1] if real is not None and "embedded" in label else kit.tokenizer
        prompts = [p.to(kit.device) for p in shapes.prompts(tok, kit.num_prompts, kit.prompt_tokens)]
        runs = [probe(forward, p, new, widths) for p in prompts]
        flips = [f | {"prompt": i} for i, r in enumerate(runs) for f in r["flips"]]
        out["models"][label] = {
            "dtype": str(dtype), "engine": "CUDA graphs" if forward.compiled and kit.device.type == "cuda" else
            "compiled" if forward.compiled else "eager", "positions": sum(r["positions"] for r in runs),
            "forwards": sum(r["forwards"] for r in runs), "flips": flips[:200], "flip_count": len(flips),
            "flips_above_rounding": sum(not f["within_bf16_rounding"] for f in flips),
            "max_abs_diff": {w: max(r["max_abs_diff"][w] for r in runs) for w in runs[0]["max_abs_diff"]},
            "min_margin": min(r["min_margin"] for r in runs if r["min_margin"] is not None),
            "ar_selfcheck": all(r["ar_selfcheck"] for r in runs)}
        if "embedded" not in label or dtype != torch.float32:
            kit.forget(model)  # (the fp32 real model's engine stays: other stages reuse it)
        kit.partial("width_probe", out)
    models = out["models"].values()
    out["all_within_rounding"] = all(m["flips_above_rounding"] == 0 for m in models) and all(
        m["flip_count"] == 0 for m in models if m["dtype"] == "torch.float32")
    return out
