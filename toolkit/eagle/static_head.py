"""An EAGLE head's forward over the engine's static cache, compiled or eager (the head of
:class:`~toolkit.speculative.drafters.eagle.EagleDrafter`).

The head's KV cache is a :class:`~toolkit.kv.static.StaticKV` of one layer (gpt-fast's layout: per-row buffers
written by slot index, a boolean mask from per-row lengths, rollback by moving lengths), sized by the head's own shape
(:func:`head_cache`). One call of :class:`HeadForward` is one head step over ``(B, W)`` (row ``r``'s first
``counts[r]`` real)::

    x       = fc(cat(embed(tokens), features))   (EAGLE-1 step 1)   | fc(features) (EAGLE-3 step 1)
            | the step input of the head's own outputs                (later steps: ``first=False``)
    out     = the head's decoder layer over x, attending to the row's cache through the static mask
    last    = out at each row's last real input                      (B, H)
    logits  = the head's LM head over last                           (B, draft_vocab)

and is ONE compiled graph per (first step or not) x (one row or more) x (one token or more): on CPU inductor with
the rows, the width and the attended span dynamic, so a process compiles at most eight small graphs, seconds each.
A token tree's expansion step (``tree``: one row, the expanded nodes appended to the head cache's tree region under
a tree mask, :mod:`toolkit.kv.static_tree`) returns every node's output and logits ``(1, W, ...)``: a graph of its
own.
A graph's first call compiles it (logged on ``toolkit.engine``; its time is counted in :attr:`HeadForward.compile_ms`,
which the decoder keeps out of a request's timings).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from toolkit.kv.static import StaticKV

log = logging.getLogger("toolkit.engine")


class _HeadShape:
    """What :class:`StaticKV` reads of a model, for a head: its text config (one layer, the head's attention shape)
    and its parameters (device and compute dtype)."""

    def __init__(self, head):
        c = head.config
        text = SimpleNamespace(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                               head_dim=c.head_dim, hidden_size=c.hidden_size, num_hidden_layers=1)
        self.config = SimpleNamespace(get_text_config=lambda decoder=True: text)
        self.parameters = head.parameters


def head_cache(head, rows: int, capacity: int, widest: int) -> StaticKV:
    """The head's static cache: ``rows`` rows of ``capacity`` positions (true pairs, one per committed token) and
    forwards of up to ``widest`` tokens past them."""
    return StaticKV(_HeadShape(head), rows, capacity, widest)


class _StaticLayerCache:
    """The head attention's cache interface (``len``, ``append``) over the static cache's layer: ``append`` writes
    the new keys and values at their slots and returns the attended span, in the head's dtype (on CPU the static
    buffers are float32 whatever the head's dtype)."""

    def __init__(self, cache: StaticKV):
        self.layer = cache.layers[0]

    def __len__(self) -> int:
        return 0  # the head always gets the static mask: its causal default is never built

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layer.update(k, v)
        return keys.to(k.dtype), values.to(v.dtype)


def _head_step(head, source: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               cache: _StaticLayerCache, last: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One head step (the compiled region; see the module docstring): the outputs at the inputs ``last`` ``(B, k)``
    picks, ``(B, k, H)``, and their logits ``(B, k, d)``."""
    x = head.input_features(source, tokens) if first else head.step_input(source, tokens)
    out, _ = head(x, tokens, positions, cache, mask)
    out = out.gather(1, last[:, :, None].expand(-1, -1, out.shape[-1]))
    return out, head.logits(out)


class HeadForward:
    """A head's step over its static cache (see the module docstring).

    Args:
        head: the loaded :class:`~toolkit.eagle.head.EagleHead`.
        compile: compile the step with ``torch.compile`` (``False``: eager).
        backend: ``torch.compile``'s (``eager`` traces without code generation: tests).

    Attributes:
        compile_ms: milliseconds spent in calls that compiled, cumulative.
    """

    def __init__(self, head, compile: bool = False, backend: str = "inductor"):
        self.head, self.backend = head, backend
        self.device = head.lm_head.weight.device
        self.dtype = next(head.parameters()).dtype
        self.compile_ms = 0.0
        self._seen: set[tuple] = set()
        self._compiled = None
        if compile:
            from toolkit.engine.forward import inductor_cache

            inductor_cache()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(_head_step, dynamic=False, backend=backend)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, cache: StaticKV, source: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                 counts_host: list[int], first: bool, tree=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step over ``tokens`` ``(B, W)`` with ``source`` ``(B, W, F)`` (the target's features for the first
        step, the head's own outputs after it) appended to the cache's ``B`` rows, which keep their first
        ``counts[r]`` entries (``counts_host`` the same on the host). Returns ``(out (B, H), logits (B, d))`` at each
        row's last real input; with ``tree`` (a token tree's region on row 0,
        :class:`~toolkit.kv.static_tree.TreeInputs`) ``(out (1, W, H), logits (1, W, d))`` at every input."""
        rows, width = tokens.shape
        kwargs = cache.prepare(width) if tree is None else cache.prepare_tree(tree, width)
        last = (counts - 1).clamp_min(0)[:, None] if tree is None else \
            torch.arange(width, device=tokens.device)[None]
        args = (self.head, source.to(self.dtype), tokens, kwargs["position_ids"], kwargs["attention_mask"],
                _StaticLayerCache(cache), last, first)
        if self._compiled is None:
            out = _head_step(*args)
        else:
            self._mark_dynamic(args, cache)
            key = (first, min(rows, 2), min(width, 2)) + (("tree",) if tree is not None else ())  # a graph of its own
            began = time.perf_counter()
            if key not in self._seen:
                log.info("compiling the EAGLE head's %s step (%s rows x %s tokens) with torch.compile: seconds",
                         "tree" if tree is not None else "first" if first else "later",
                         *("2+" if n > 1 else "1" for n in key[1:3]))
            out = self._compiled(*args)
            if key not in self._seen:
                self._seen.add(key)
                self.compile_ms += (time.perf_counter() - began) * 1000
        cache.accept(counts, counts_host)
        return out if tree is not None else (out[0][:, 0], out[1][:, 0])

    @staticmethod
    def _mark_dynamic(args: tuple, cache: StaticKV) -> None:
        """Rows and width where they exceed 1, and the attended span: one graph per class of shapes."""
        _, source, tokens, positions, mask, _, last, _ = args
        rows, width = tokens.shape
        torch._dynamo.mark_dynamic(mask, 3)
        for tensor in (tokens, positions, cache.write_index, source, *((last,) if last.shape[1] > 1 else ())):
            if width > 1:
                torch._dynamo.mark_dynamic(tensor, 1)
            if rows > 1:
                torch._dynamo.mark_dynamic(tensor, 0)
        if width > 1:
            torch._dynamo.mark_dynamic(mask, 2)
        if rows > 1:
            for tensor in (mask, last, cache.row_index):
                torch._dynamo.mark_dynamic(tensor, 0)
