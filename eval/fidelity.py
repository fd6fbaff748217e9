"""How far a greedy output is from the target's own AR output: the first divergence and its logit margin.

What "lossless" means per precision (stated in the README, tested in ``tests/test_low_precision.py``):

* fp32 — speculative greedy output is token-identical to AR greedy on the same weights.
* bf16 / fp16 / int8 / int4 — a verify forward over several tokens and a one-token step round differently, so at a
  *near-tie* (the target's two best tokens within its rounding error) the speculative text may take the other token,
  and from there continue differently. Nothing else changes: away from near-ties the text is identical, and under
  sampling the distribution is the target's. Reports give, per prompt, whether the text is identical, the first
  divergent token and the margin ``|logit(AR token) - logit(ours)|`` of the target there, recomputed in one forward
  over the common prefix; a near-tie has a margin of the order of the precision's rounding (bf16: ~0.1 logits).
"""

from __future__ import annotations

import torch


def first_divergence(model, prompt_ids: torch.Tensor, reference: list[int], ours: list[int]) -> dict | None:
    """Where ``ours`` first differs from ``reference`` (both new-token lists after ``prompt_ids`` ``(1, n)``).

    Returns ``None`` when one is a prefix of the other, else ``{"index", "reference_token", "ours_token",
    "margin", "matched_fraction"}`` with ``margin`` the target's logit gap between the two tokens at that position
    (one forward over prompt + common prefix, on ``model``'s device and weights).
    """
    index = next((i for i, (a, b) in enumerate(zip(reference, ours)) if a != b), None)
    if index is None:
        return None
    device = next(model.parameters()).device
    prefix = torch.tensor([prompt_ids[0].tolist() + reference[:index]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=prefix, logits_to_keep=1).logits[0, -1].float()
    margin = abs(float(logits[reference[index]] - logits[ours[index]]))
    return {"index": index, "reference_token": reference[index], "ours_token": ours[index],
            "margin": round(margin, 4), "matched_fraction": round(index / max(len(reference), 1), 4)}


def agreement(rows: list[dict]) -> dict:
    """Summary over per-prompt ``{"identical": bool, "divergence": dict | None}``: identical prompts, the mean
    fraction of each output matched before its first divergence, the largest margin at a divergence."""
    margins = [r["divergence"]["margin"] for r in rows if r.get("divergence")]
    matched = [1.0 if r["identical"] or not r.get("divergence") else r["divergence"]["matched_fraction"]
               for r in rows]
    return {"identical": sum(1 for r in rows if r["identical"]), "prompts": len(rows),
            "matched_fraction": round(sum(matched) / len(matched), 4) if matched else 1.0,
            "max_divergence_margin": max(margins) if margins else None}
