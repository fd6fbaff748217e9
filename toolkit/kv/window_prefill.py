"""A prompt's prefill under StreamingLLM's exact window, in chunks that attend only to what the window shows.

Under the exact window (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024; the
ring of :mod:`toolkit.kv.static`) a prompt query at position ``p`` sees the ``sink_tokens`` sinks and positions ``p -
window + 1 .. p``. One forward over an ``n``-token prompt expresses that with a boolean ``(1, 1, n, n)`` band mask
(1 GiB at 32k tokens) and a cache of all ``n`` positions; the static attention then runs it
128 queries at a time over the keys each chunk sees (:func:`toolkit.kv.attention.chunked_sdpa`): 256 gathers and
SDPA calls per layer at 32k tokens. On an H100 (2026-11-27) a 32k-token prompt of the 1B shape under a 4,092-token
window took ~0.6 s more per row than the uncompressed cache's causal prefill.

:class:`WindowedPrompt` runs the prompt through the model in chunks of ``chunk`` tokens instead. Before each chunk it
holds the sinks and the newest ``tail`` positions (``tail >= window``: every key a chunk query can see that precedes
the chunk); the chunk attends to those and to itself under a ``(1, 1, chunk, held + chunk)`` mask, so the prompt's
cache and mask never exceed ``sinks + tail + chunk`` positions and the attention costs ``n * (sinks + tail +
chunk)`` pairs. Every query sees exactly the keys the one masked forward shows it: the logits and the kept keys and
values are the same up to floating-point summation order.

Not on a CPU by default (:data:`CHUNK_TOKENS`): measured on this 2-core CPU with a window of 1/8 of the prompt, the
embedded model in fp32 gained at 8,000 tokens (18.9-21.1 s -> 17.0-17.5 s in chunks of 512) and nothing at 4,096
(7.7-8.6 s either way), but on the GGUF's own Q4_1 blocks (the shipped `long` recipe) a 4,096-token prompt took
4.4-5.5 s whole against 6.0-6.9 s in chunks of 512, 1,024 or 2,048 (more calls of those weights' prompt-sized
matmuls, each with a fixed cost of its own: not profiled), while the static attention's query chunks already keep
the masked pairs out there. On an accelerator the chunks replace thousands of small gathers and SDPA calls; the GPU
kit's ``kv_long`` stage times both forms of the prompt side by side.

The cache that takes the row (:meth:`toolkit.kv.static.StaticKV.load_row`) reads the positions it keeps through
:meth:`WindowedPrompt.index_of`: the sinks and the newest ``tail`` positions are there, as they are in a prompt
prefilled whole.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

#: tokens per chunk on a CPU (``None``: a prompt runs whole there; the module docstring's measurements) and on an
#: accelerator, where a chunk also amortizes one read of the weights
CHUNK_TOKENS: dict[str, int | None] = {"cpu": None, "other": 2048}


def chunk_tokens(device) -> int | None:
    """Tokens per chunk of a windowed prefill on ``device`` (:data:`CHUNK_TOKENS`; ``None``: never chunked)."""
    return CHUNK_TOKENS["cpu" if torch.device(device).type == "cpu" else "other"]


def prompt_cache(window, length: int, device, tail: int | None = None) -> tuple[DynamicCache, dict]:
    """``(cache, kwargs)`` of a prompt of ``length`` tokens prefilled alone into an empty cache: a
    :class:`WindowedPrompt` keeping ``tail`` positions between chunks (its ``kwargs`` the cache alone; the forward
    runs its chunks) where :meth:`WindowedPrompt.pays`, else (or with no ``tail``) a ``DynamicCache`` with
    ``position_ids`` ``(1, length)`` and, under a ``window`` (a StreamingLLM policy or ``None``), its boolean ``(1,
    1, length, length)`` band mask."""
    chunk = chunk_tokens(device)
    if tail is not None and chunk is not None and WindowedPrompt.pays(window, length, tail, chunk):
        cache = WindowedPrompt(window, length, tail, chunk)
        return cache, {"past_key_values": cache}
    cache = DynamicCache()
    kwargs = {"position_ids": torch.arange(length, device=device).view(1, -1), "past_key_values": cache}
    if window is not None:
        kwargs["attention_mask"] = window.prompt_mask(length, device)
    return cache, kwargs


class WindowedPrompt(DynamicCache):
    """The ``DynamicCache`` of one prompt of ``length`` tokens prefilled in chunks under ``policy``'s exact window.

    Args:
        policy: a :class:`~toolkit.kv.streaming.StreamingLLM` with the exact window.
        length: the prompt's tokens.
        tail: newest positions kept between chunks (``>= policy.window``; the static ring's ``window + widest``).
        chunk: tokens per forward (:func:`chunk_tokens`).

    Attributes:
        held_from: absolute position of the first non-sink entry held (the sinks are positions ``0 ..
            sink_tokens - 1``; entries above them are ``held_from .. `` the last position prefilled).

    Raises:
        ValueError: ``tail < policy.window`` or ``chunk < 1``.
    """

    def __init__(self, policy, length: int, tail: int, chunk: int):
        if tail < policy.window or chunk < 1:
            raise ValueError(f"WindowedPrompt: tail must be >= the window ({policy.window}) and chunk >= 1, got "
                             f"{tail} and {chunk}")
        super().__init__()
        self.policy, self.length, self.tail, self.chunk = policy, length, tail, chunk
        self.held_from = 0

    @staticmethod
    def pays(policy, length: int, tail: int, chunk: int) -> bool:
        """Whether chunking a ``length``-token prompt drops anything: the prompt is longer than one chunk past what
        the window keeps (shorter ones run as one masked forward)."""
        return policy is not None and getattr(policy, "ring", False) and length > policy.sink_tokens + tail + chunk

    def prefill(self, forward, input_ids: torch.Tensor):
        """Run ``input_ids`` ``(1, length)`` through ``forward(ids, kwargs)`` (one model forward on ``kwargs``:
        ``position_ids``, ``attention_mask``, ``past_key_values``; returns logits ``(vocab,)`` of its last position,
        or ``(logits, features (1, n, F))``) chunk by chunk, trimming to the sinks and the newest ``tail`` positions
        after each. Returns the last chunk's logits, with the chunks' features joined ``(1, length, F)`` where
        ``forward`` returns features."""
        features, out = [], None
        for start in range(0, self.length, self.chunk):
            stop = min(self.length, start + self.chunk)
            out = forward(input_ids[:, start:stop], self._chunk_kwargs(start, stop, input_ids.device))
            if isinstance(out, tuple):
                features.append(out[1])
            self._trim(stop)
        return (out[0], torch.cat(features, dim=1)) if features else out

    def index_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Entries of this cache holding absolute ``positions`` (the sinks or positions ``>= held_from``)."""
        sinks = self.policy.sink_tokens
        if self.held_from <= sinks:
            return positions
        return torch.where(positions < sinks, positions, positions - self.held_from + sinks)

    # ------------------------------------------------------------------------------------------------ internals
    def _held_positions(self, start: int) -> torch.Tensor:
        """Absolute positions of the entries held before the chunk starting at ``start``."""
        sinks = min(self.policy.sink_tokens, start)
        if self.held_from <= sinks:
            return torch.arange(start)
        return torch.cat([torch.arange(sinks), torch.arange(self.held_from, start)])

    def _chunk_kwargs(self, start: int, stop: int, device) -> dict:
        keys = torch.cat([self._held_positions(start), torch.arange(start, stop)]).to(device)
        queries = torch.arange(start, stop, device=device)[:, None]
        mask = self.policy.sees(keys[None, :], queries)
        return {"position_ids": queries.view(1, -1), "attention_mask": mask[None, None], "past_key_values": self}

    def _trim(self, stop: int) -> None:
        """Keep the sinks and the newest ``tail`` of the ``stop`` positions prefilled so far."""
        sinks = self.policy.sink_tokens
        first = max(sinks, stop - self.tail)
        if first <= max(self.held_from, sinks):
            return  # nothing old enough to drop yet
        for layer in self.layers:
            held = layer.keys.shape[-2]
            layer.keys = torch.cat([layer.keys[..., :sinks, :], layer.keys[..., held - (stop - first):, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :sinks, :],
                                      layer.values[..., held - (stop - first):, :]], dim=-2)
        self.held_from = first
