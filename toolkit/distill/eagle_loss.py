"""The EAGLE head unrolled for training (EAGLE-3's training-time test), its loss, and the held-out acceptance curve
(see :mod:`toolkit.distill.eagle_train` for the recipe).

Shapes: ``features`` ``(b, L, H)`` normed target features, ``tokens`` ``(b, L)`` int64; outputs of draft step s
``(b, L-1, H)``. An EAGLE-3 head reads its step-1 input from ``inputs`` ``(b, L, 3H)`` (three target layers'
outputs, the cache's ``aux``), learns tokens only (no feature regression: its output is its own hidden state, not
the target's feature) and trains its own LM head, so the target's distribution comes from a frozen copy of the
target's LM-head rows (``target_lm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------------------ the unrolled head
def ttt_mask(length: int, step: int, device) -> torch.Tensor:
    """Attention mask ``(length, step * length)`` of draft step ``step`` (1-based) in the unrolled head: the query
    at position t sees step-1 keys at positions <= t - step + 1 and step-j keys (2 <= j <= step) at t - step + j."""
    pos = torch.arange(length, device=device)
    blocks = [pos[None, :] <= (pos[:, None] - step + 1)]
    for j in range(2, step + 1):
        blocks.append(pos[None, :] == (pos[:, None] - step + j))
    mask = torch.cat(blocks, dim=1)
    mask[:, (step - 1) * length:].fill_diagonal_(True)  # own key: never an empty row
    return mask


def input_key(head) -> str:
    """The feature-cache tensor a head reads at step 1: ``aux`` (EAGLE-3) or ``features`` (EAGLE-1)."""
    return "aux" if head.config.variant == "eagle3" else "features"


def unroll(head, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Outputs of ``steps`` unrolled draft steps over a batch: ``features`` ``(b, L, F)`` (the head's step-1 input:
    normed target features, or EAGLE-3's three-layer ``aux``), ``tokens`` ``(b, L)``. Level s output at position t
    predicts token t+2 from the chain that starts with the true pair at t-s+1. Returns ``[out_1 .. out_steps]``
    each ``(b, L-1, H)``."""
    b, length = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(length, device=tokens.device).expand(b, length)
    next_tokens = tokens[:, 1:]
    x = head.input_features(features[:, :-1], next_tokens)
    keys, values = [], []
    outs = []
    for s in range(1, steps + 1):
        if s > 1:
            prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)  # out at t-1 -> input t
            x = head.step_input(prev, next_tokens)
        extra = (torch.cat(keys, dim=2), torch.cat(values, dim=2)) if keys else None
        mask = ttt_mask(length, s, tokens.device)
        out, (k, v) = head(x, next_tokens, positions, None, mask, extra)
        keys.append(k)
        values.append(v)
        outs.append(out)
    return outs


def target_log_probs(head, features: torch.Tensor, target_lm: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token log-probabilities restricted to the draft vocabulary, renormalised:
    ``(..., draft_vocab)`` from normed features ``(..., H)`` through the target's LM-head rows ``target_lm``
    ``(draft_vocab, H)`` (default: the head's frozen LM head, which is those rows for an EAGLE-1 head)."""
    weight = head.lm_head.weight if target_lm is None else target_lm
    return F.log_softmax(F.linear(features, weight.to(features.dtype)).float(), dim=-1)


def _target_argmax(cache: dict, full_lm_head: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each position ``t + 1``: ``(n, L-1)``, computed once and kept in ``cache``."""
    if "target_next" not in cache:
        rows = []
        with torch.inference_mode():
            for i in range(0, cache["features"].shape[0], 8):  # on the LM head's device, kept on the CPU
                features = cache["features"][i:i + 8, 1:].to(full_lm_head.device).float()
                rows.append((features @ full_lm_head.T).argmax(-1).cpu())
        cache["target_next"] = torch.cat(rows)
    return cache["target_next"]


def alpha_curve(head, cache: dict, k: int, full_lm_head: torch.Tensor, kinds=(1,), batch: int = 8) -> dict:
    """Held-out acceptance per draft position (greedy; see the module docstring). Returns ``{"alpha": [k],
    "tau": expected tokens per round with K=k (accepted + bonus), "chains": n}``."""
    sel = torch.isin(cache["kind"], torch.tensor(list(kinds)))
    feats, toks, mask = cache[input_key(head)][sel], cache["tokens"][sel], cache["mask"][sel]
    device = head.draft_to_target.device  # the head's device: batches move there (the caches stay on the CPU)
    reached = torch.zeros(k + 1)
    with torch.inference_mode():
        for i in range(0, feats.shape[0], batch):
            f = feats[i:i + batch].to(device).float()
            t, m = toks[i:i + batch].to(device), mask[i:i + batch].to(device)
            outs = unroll(head, f, t, k)
            target_next = _target_argmax(cache, full_lm_head)[sel][i:i + batch].to(device)  # (b, L-1)
            ok = []
            for s, out in enumerate(outs, start=1):
                draft = head.draft_to_target[head.logits(out).argmax(-1)]
                good = (draft == target_next) & m[:, 1:] & torch.cat(
                    [m[:, 2:], torch.zeros_like(m[:, :1])], dim=1)
                ok.append(good)
            length = toks.shape[1] - 1
            # chain starting at m0 (true pair at m0): step s correct = ok[s-1][:, m0 + s - 1]
            alive = m[:, 1:] & torch.cat([m[:, 2:], torch.zeros_like(m[:, :1])], dim=1)
            # chains start where drafting starts at inference: at the last prompt position or later
            start = cache["answer_start"][sel][i:i + batch].to(device)
            alive &= torch.arange(length, device=device)[None, :] >= (start[:, None] - 1)
            reached[0] += alive.sum().item()
            for s in range(1, k + 1):
                shifted = torch.zeros_like(alive)
                shifted[:, :length - s + 1] = ok[s - 1][:, s - 1:]
                alive = alive & shifted
                reached[s] += alive.sum().item()
    alpha = [(reached[s] / reached[s - 1]).item() if reached[s - 1] > 0 else 0.0 for s in range(1, k + 1)]
    tau = 1.0 + sum((reached[s] / reached[0]).item() for s in range(1, k + 1))
    return {"alpha": alpha, "tau": tau, "chains": int(reached[0])}


def head_loss(head, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, weights: list[float],
              reg_weight: float, std: torch.Tensor | float = 1.0, autocast: bool = False,
              inputs: torch.Tensor | None = None, target_lm: torch.Tensor | None = None):
    """The training loss over a batch: for each unrolled step s (weight ``weights[s-1]``), KL(target || head) over
    the draft vocabulary + (EAGLE-1 only) ``reg_weight`` x SmoothL1 of the standardised feature error, averaged over
    ``valid`` ``(b, L-1)`` positions (step s only from position s-1 on). ``features`` ``(b, L, H)`` normed target
    features (the target's next-token law), ``tokens`` ``(b, L)``; ``inputs`` the head's step-1 input (default
    ``features``; EAGLE-3: ``aux`` ``(b, L, 3H)``), ``target_lm`` see :func:`target_log_probs`. Returns
    ``(loss, [per-step KL in nats])``."""
    regress = head.config.variant == "eagle1" and reg_weight > 0
    with torch.no_grad():
        goal = features[:, 1:]  # outputs at position t predict the feature of token t+1 (its next-token law)
        p_log = target_log_probs(head, goal, target_lm)
        p = p_log.exp()
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        outs = unroll(head, features if inputs is None else inputs, tokens, len(weights))
    loss = 0.0
    parts = []
    denom = valid.sum().clamp_min(1)
    for s, (w, o) in enumerate(zip(weights, outs)):
        level_valid = valid.clone()
        level_valid[:, :s] = 0
        logq = F.log_softmax(head.logits(o.float()).float(), dim=-1)
        kl = (p * (p_log - logq)).sum(-1)
        if regress:
            kl_reg = kl + reg_weight * F.smooth_l1_loss(o.float() / std, goal / std, reduction="none").mean(-1)
        else:
            kl_reg = kl
        loss = loss + w * (kl_reg * level_valid).sum() / denom
        parts.append(round(float(kl.detach().mul(level_valid).sum() / denom), 4))
    return loss, parts
