"""Held-out evaluation of a draft against its target: top-1 agreement, KL, and speculative acceptance.

* **top-1 agreement**: over held-out windows ``(W, seq_len)``, the fraction of positions where
  ``argmax draft logits == argmax target logits`` (teacher forcing on real text).
* **KL**: mean per-token ``KL(p_target || p_draft)`` at temperature 1, in nats.
* **alpha / tau**: the draft drives :class:`toolkit.engine.decoder.SpeculativeDecoder` through
  :class:`toolkit.speculative.drafters.DraftModel` with constant K (greedy, EOS ignored) on held-out prompts;
  alpha = accepted / drafted and tau = tokens committed per round, summed over all prompts (DistillSpec, Zhou et
  al. 2024, measure the same two quantities).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def kd_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``tau^2 * KL(softmax(z_t / tau) || softmax(z_s / tau))`` averaged over positions (nats per token).

    Args:
        teacher_logits / student_logits: ``(..., vocab)``; computed in fp32.
        temperature: tau > 0. The tau^2 factor keeps gradient magnitudes comparable across temperatures
            (Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network").
    Returns: a scalar tensor.
    """
    vocab = teacher_logits.shape[-1]
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
    return kl * temperature**2


@torch.no_grad()
def agreement(target, draft, windows: torch.Tensor, batch_size: int = 4, autocast_dtype=None) -> dict:
    """Top-1 agreement and KL (tau = 1) of ``draft`` vs ``target`` on ``windows`` ``(W, seq_len)`` int64.

    Returns ``{"top1_agreement": fraction, "kl": nats/token, "tokens": W * seq_len}`` (zeros when W = 0).
    """
    if windows.numel() == 0:
        return {"top1_agreement": 0.0, "kl": 0.0, "tokens": 0}
    device = next(draft.parameters()).device
    was_training = draft.training
    draft.eval()
    same = total = 0
    kl_sum = 0.0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i:i + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            t_logits = target(input_ids=batch).logits.float()
            d_logits = draft(input_ids=batch).logits.float()
        same += int((t_logits.argmax(-1) == d_logits.argmax(-1)).sum())
        total += batch.numel()
        kl_sum += float(kd_loss(t_logits, d_logits, 1.0)) * batch.numel()
    draft.train(was_training)
    return {"top1_agreement": same / total, "kl": kl_sum / total, "tokens": total}


@torch.no_grad()
def acceptance(target, draft, prompts: torch.Tensor, max_new_tokens: int, k: int) -> dict:
    """Speculative decoding with ``draft`` as a :class:`DraftModel`, greedy, constant K = ``k``, EOS ignored.

    Args:
        prompts: ``(P, prompt_len)`` int64 held-out prompts.
    Returns ``{"alpha", "tokens_per_round", "rounds", "drafted", "accepted", "new_tokens", "prompts",
    "seconds"}`` summed over prompts (alpha = accepted / drafted, tokens per round = committed / rounds).
    """
    from toolkit.recipe import GenerationSpec
    from toolkit.engine.planner import ConstantK
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.stats import GenerationStats, acceptance_summary

    was_training = draft.training
    draft.eval()
    gen = GenerationSpec(max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
    runs = []
    start = time.perf_counter()
    for row in prompts:
        decoder = SpeculativeDecoder(target, DraftModel(draft), ConstantK(k))
        stats = GenerationStats()
        for _ in decoder.decode(row.view(1, -1), gen, stats):
            pass
        runs.append(stats)
    draft.train(was_training)
    summary = acceptance_summary(runs)
    return {
        "alpha": summary["acceptance_rate"], "tokens_per_round": summary["tokens_per_round"],
        "rounds": summary["rounds"], "drafted": summary["drafted"], "accepted": summary["accepted"],
        "new_tokens": summary["new_tokens"], "prompts": int(prompts.shape[0]), "k": k,
        "seconds": time.perf_counter() - start,
    }


def evaluate(target, draft, windows: torch.Tensor, prompts: torch.Tensor, max_new_tokens: int, k: int,
             autocast_dtype=None) -> dict:
    """Agreement/KL on ``windows`` plus alpha/tau on ``prompts``: one flat dict (see the two functions)."""
    result = agreement(target, draft, windows, autocast_dtype=autocast_dtype)
    if prompts.numel():
        spec = acceptance(target, draft, prompts, max_new_tokens, k)
        result.update(alpha=spec["alpha"], tokens_per_round=spec["tokens_per_round"], spec=spec)
    return result
