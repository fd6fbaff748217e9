"""Token choice and acceptance for every row of a round, on the device: the round's one host transfer reads the result.

* :func:`choose` — the target's token from logits: argmax (greedy) or a sample after temperature / top-k / top-p.
* :func:`accept` — for each row, how many of its draft tokens the target accepts and the token committed after them
  (the correction at the first rejection, or the bonus token after the last draft token): greedy compares the
  target's argmax with the drafts and counts the agreeing prefix (one ``cumprod`` over the batch); sampling runs
  lossless speculative sampling per row (Leviathan et al., 2023, Alg. 1; :func:`toolkit.speculative.verify.
  speculative_sample`) with the row's own generator. Nothing is read back to the host here.
* :func:`kept` — each row's kept token count from :func:`accept`'s result (what the cache keeps at the commit).
* :func:`accept_tree` — greedy acceptance of a token tree (one row): the deepest node whose every ancestor's token,
  and its own, is the target's argmax at its parent, found with a few tensor ops on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.speculative.verify import process_logits, sample_token, speculative_sample


def on_host(tensor: torch.Tensor) -> bool:
    """Whether greedy choice and acceptance run in NumPy (CPU tensors: they are host memory already, so the NumPy
    views read nothing back from a device). ``tests/test_host_syncs.py`` switches it off to count, on a CPU, the reads
    that the device path makes on a GPU."""
    return tensor.device.type == "cpu"


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: ``(..., vocab)`` -> ``(...)`` long, the same index (the first maximal one). On a CPU the
    argmax runs in NumPy over fp32 (bf16 / fp16 widened first, which is exact): ATen's CPU argmax reduces one element
    at a time, NumPy's is vectorized. Over a 49,152-token vocabulary on the 2-core AVX-512 machine (docs/design.md): one
    position 43 us in ATen, 6 us in NumPy; five positions 127-210 us, 20 us (bf16: 177 us in ATen before the
    widening). A decode round reads it once per verify, right after the target's forward."""
    if not on_host(logits) or logits.requires_grad:
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(_argmax_on_host(logits)))


def _argmax_on_host(logits: torch.Tensor) -> np.ndarray:
    """:func:`greedy`'s NumPy argmax of CPU ``logits`` ``(..., vocab)`` -> ``(...)`` int64 (bf16 / fp16 widened to fp32
    first, which is exact; a tensor that requires grad read detached)."""
    if logits.requires_grad:
        logits = logits.detach()
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return np.argmax(logits.numpy(), -1)


def choose(logits: torch.Tensor, gen, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``(n, vocab)``: argmax, or (``gen.do_sample``) a sample with ``generator``
    from the processed distribution. Returns ``(n,)`` long on the logits' device."""
    if gen.do_sample:
        return sample_token(process_logits(logits, gen.temperature, gen.top_k, gen.top_p), generator)
    return greedy(logits)


def accept(logits: torch.Tensor, inputs: torch.Tensor, drafted: torch.Tensor, counts: list[int], gen,
           rows: list) -> torch.Tensor:
    """Verify a round.

    Args:
        logits: ``(B, W, vocab)`` target logits of the verify forward; position ``i`` predicts the token after input
            ``i``.
        inputs: ``(B, W)`` the forward's inputs on the device: each row's last committed token, its draft tokens, then
            padding.
        drafted: ``(B,)`` long on the device: per row, how many of its inputs after the first are draft tokens (the
            rest is padding, never accepted).
        counts: the same counts on the host.
        gen: the generation settings (``do_sample``, ``temperature``, ``top_k``, ``top_p``).
        rows: the rows (``generator`` and ``q`` — the draft probabilities ``(proposal, vocab)`` of sampled drafts,
            ``None`` for deterministic ones — are read under sampling).

    Returns:
        ``(B, 2)`` long on the device: accepted count and the next token, per row.
    """
    width = inputs.shape[1]
    if not gen.do_sample and on_host(logits):
        return _greedy_on_host(logits, inputs, drafted)
    if not gen.do_sample:
        best = greedy(logits)  # (B, W)
        valid = torch.arange(width - 1, device=inputs.device)[None, :] < drafted[:, None]
        agree = (best[:, : width - 1] == inputs[:, 1:]) & valid
        accepted = agree.long().cumprod(1).sum(1)
        return torch.stack([accepted, best.gather(1, accepted[:, None])[:, 0]], 1)
    results = []
    for i, (row, d) in enumerate(zip(rows, counts)):
        p = process_logits(logits[i, : d + 1], gen.temperature, gen.top_k, gen.top_p)
        q = None if row.q is None else row.q[:d]
        results.append(torch.stack(speculative_sample(inputs[i, 1: d + 1], q, p, row.generator)))
    return torch.stack(results)


def _greedy_on_host(logits: torch.Tensor, inputs: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """:func:`accept`'s greedy branch for CPU logits, the same steps in NumPy: a round's tensors are a few dozen
    numbers after the argmax, where each ATen call costs more than its work (on the 2-core machine, one position: 24
    against 43 us hot; 180-190 against 256-280 us a round inside the llama.cpp backend's decode loop, where a decode
    has just streamed the weights through the caches). The argmax reads the logits' own NumPy view
    (:func:`_argmax_on_host`, as :func:`greedy`), and the result is one NumPy array handed to torch once."""
    best = _argmax_on_host(logits)  # (B, W)
    rows, width = best.shape
    result = np.zeros((rows, 2), np.int64)
    if width == 1:  # a plain step: nothing to compare
        result[:, 1] = best[:, 0]
        return torch.from_numpy(result)
    valid = np.arange(width - 1)[None, :] < drafted.numpy()[:, None]
    agree = (best[:, : width - 1] == inputs.numpy()[:, 1:]) & valid
    result[:, 0] = np.cumprod(agree, 1).sum(1)
    result[:, 1] = best[np.arange(rows), result[:, 0]]
    return torch.from_numpy(result)


def kept(result: torch.Tensor) -> torch.Tensor:
    """Each row's kept tokens (accepted drafts + the committed one) from :func:`accept`'s ``result`` ``(B, 2)``:
    ``(B,)`` long on its device, with no host read; on a CPU through the NumPy view (two ATen calls there cost
    more than the work, host time between two target forwards)."""
    if on_host(result):
        return torch.from_numpy(result.numpy()[:, 0] + 1)
    return result[:, 0] + 1


def accept_tree(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a token tree's forward, on the device (the same path as
    :func:`~toolkit.speculative.tree_verify.tree_speculative_sample` would take with one-hot target distributions:
    the output of greedy autoregressive decoding).

    Args:
        logits: ``(W, vocab)`` target logits of ``[root, nodes]`` (query ``i`` predicts the token after node ``i``).
        tokens: ``(W,)`` long: the root's and the nodes' tokens.
        parents: ``(W,)`` long: the query index of each entry's parent (the root: 0).
        depth: ``(W,)`` long: each entry's depth (the root: 0).
        ancestors: ``(W, W)`` bool: ``ancestors[i, k]`` iff ``k`` is ``i`` or one of its ancestors.

    Returns:
        ``(result, keep)``: ``result`` ``(2,)`` long — the deepest accepted entry's query index (0: no node was
        accepted; the first such index among equally deep ones) and the target's argmax after it (the correction or
        the bonus token); ``keep`` ``(W,)`` bool — the root and the accepted path.
    """
    width = tokens.shape[0]
    index = torch.arange(width, device=tokens.device)
    best = greedy(logits)
    match = (tokens == best.index_select(0, parents)) | (index == 0)
    accepted = ~(ancestors & ~match[None, :]).any(-1)  # it and every ancestor match
    deepest = torch.where(accepted, depth * width + (width - 1 - index), -1).argmax()
    return torch.stack([deepest, best[deepest]]), ancestors[deepest]
