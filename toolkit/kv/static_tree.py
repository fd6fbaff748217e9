"""Token trees on the static engine (:mod:`toolkit.kv.static`): a tree forward over a row's next slots, and the
accepted path gathered in place.

A token tree (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024; :mod:`toolkit.speculative.tree`) is verified by
the target — or expanded level by level by a drafter — on row 0 of a static cache. Its *region* is a run of the row's
slots in node order: region entry ``k`` sits in the slot a chain forward gives the ``k``-th position after the
region's first position ``b``, but holds a node at position ``b + depth[k]`` (nodes share depths, so slot order is
not position order). The target's verify forward writes its whole region at once (the root, the last committed token,
at depth 0, then the ``n`` nodes); a drafter's expansion forwards append one level each to a region that already
holds the earlier levels (its region starts below the root, which the drafter's cache holds as a committed token).

Masks. A query at position ``b + d`` must see the committed slots the policy shows a query at that position (windows
by position, KIVI's quantization boundary, eviction fills), and of the region exactly its ancestors and itself. Every
static form builds the first part for chain forwards, so a tree forward takes a chain forward's inputs over the whole
region (``prepare(t)`` from ``b``: its write indices are the region's slots, its query ``d`` sits at ``b + d``) and
derives its own from them on the device, without knowing the form:

* query ``i`` (depth ``d_i``) takes chain query ``d_i``'s row of every mask;
* in the region's columns, entry ``k`` (depth ``d_k``) is seen iff chain query ``d_i`` sees the chain's slot of
  position ``b + d_k`` (the policy's rule between the two positions) and ``k`` is ``i`` or one of its ancestors.

Positions are ``b + depth``. The inputs keep the kinds and shapes of a chain forward's — position ids ``(1, W)``, one
boolean mask ``(1, 1, W, span)`` per mask of the form, write indices ``(1, W)`` — so the compiled graphs of chain
forwards (dynamic widths on CPU, width buckets on CUDA) run tree forwards as they are. Rings need the region within
their ``widest`` extra slots (the caches are built for the widest tree forward or expansion region).

Keeping the accepted path (:meth:`TreeRows.keep_tree`): the region's entries are permuted in place so that the kept
ones (root and path, in depth order) fill its first slots — one ``index_select`` and one ``index_copy_`` per buffer a
forward writes (every layer's keys and values: plain buffers, rings, eviction tiers, KIVI's fp residual), with the
indices on the device; the caller's ``accept`` then advances the row's lengths (and eviction fills) by the kept count
as after a chain, and its commit point compresses as after any round. Entries past the kept ones lie past the row's
length: rollback stays exact.

A form says which masks it has and which slots its buffers are written at through :meth:`TreeRows.tree_view` and
:meth:`TreeRows.tree_entries` (defaults here: one mask and one write index; every layer's keys and values at its
``where()``), and refuses a tree it cannot hold exactly in :meth:`TreeRows.check_tree_room` (KIVI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class TreeInputs:
    """A tree region on row 0 of a static cache (see the module docstring).

    Attributes:
        depth: ``(t,)`` long on the device: each region entry's position minus the region's first position.
        ancestors: ``(t, t)`` bool on the device: ``ancestors[i, k]`` iff region entry ``k`` is ``i`` or one of its
            ancestors (what ``i`` sees of the region).
        new: entries the forward writes, the region's last ``new`` (the earlier ones are in the cache already).
        deepest: the largest depth (host).
        rooted: whether the region's first entry is the root every other entry descends from (a verify region;
            an expansion region starts below the root).
    """

    depth: torch.Tensor
    ancestors: torch.Tensor
    new: int
    deepest: int
    rooted: bool

    @classmethod
    def build(cls, parents: list[int], depth: list[int], new: int, rooted: bool, device) -> TreeInputs:
        """From host lists over the region: ``parents[k]`` the region index of entry ``k``'s parent (``-1``: none in
        the region; parents come before children) and ``depth[k]``. Raises ``ValueError`` for a parent not before its
        child."""
        ancestors = torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for k, parent in enumerate(parents):
            if not -1 <= parent < k:
                raise ValueError(f"parents[{k}] = {parent}: a parent must be -1 or an earlier region entry")
            if parent >= 0:
                ancestors[k] = ancestors[parent]
            ancestors[k, k] = True
        return cls(torch.tensor(depth, dtype=torch.long, device=device), ancestors.to(device), new,
                   max(depth, default=0), rooted)

    def padded(self, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(depth, ancestors)`` with ``pad`` padding entries appended (a bucketed forward's extra tokens): depth 0,
        each seeing only itself of the region; they are never kept."""
        if pad == 0:
            return self.depth, self.ancestors
        t = self.depth.numel()
        depth = torch.cat([self.depth, self.depth.new_zeros(pad)])
        ancestors = torch.eye(t + pad, dtype=torch.bool, device=self.ancestors.device)
        ancestors[:t, :t] = self.ancestors
        return depth, ancestors


class TreeRows:
    """Token-tree forwards and path gathers on row 0 of a static cache (mixed into
    :class:`~toolkit.kv.static.StaticKV`; see the module docstring)."""

    # ------------------------------------------------------------------------------------------------ the forms
    def tree_view(self, view: Callable) -> object:
        """Apply ``view(mask, write_index) -> (mask, write_index)`` to every mask of the forward just prepared and the
        write index of its columns (``None`` for a mask over no written slot); returns the model's ``attention_mask``.
        The default: one mask and one write index (:class:`~toolkit.kv.static.StaticKV`: plain and ring)."""
        self.attention_mask, self.write_index = view(self.attention_mask, self.write_index)
        return self.attention_mask

    def tree_entries(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(buffer (rows, heads, slots, head_dim), slots (1, W) it is written at)`` for every buffer the forward
        just prepared writes; the default: each layer's keys and values at its ``where()``."""
        for layer in self.layers:
            index = layer.where()[0]
            yield layer.keys, index
            yield layer.values, index

    def check_tree_room(self, start: int, tree: TreeInputs) -> None:
        """Raise ``ValueError`` where the form cannot hold ``tree``'s region from position ``start`` exactly (every
        form can, but KIVI's, whose quantization groups must not hold a node)."""

    # ------------------------------------------------------------------------------------------------ a forward
    def prepare_tree(self, tree: TreeInputs, width: int) -> dict:
        """Model inputs of a forward writing ``tree``'s last ``tree.new`` region entries (padded to ``width``
        tokens) to row 0: ``position_ids`` ``(1, width)`` and the form's boolean masks ``(1, 1, width, span)`` (see
        the module docstring); sets where the layers write. Reads no device value.

        Raises:
            ValueError: a region the form cannot hold (:meth:`check_tree_room`), or as the form's ``prepare``.
        """
        earlier = tree.depth.numel() - tree.new
        depth, ancestors = tree.padded(width - tree.new)
        self.check_tree_room(self.held[0] - earlier, tree)
        with self._rewound(earlier):
            kwargs = self.prepare(earlier + width, range(0, 1))
        queries, sees = depth[earlier:], ancestors[earlier:]

        def view(mask: torch.Tensor, index: torch.Tensor | None):
            rows = mask.index_select(2, queries)
            if index is None:
                return rows, None
            region = index[0]
            by_position = rows.index_select(3, region.index_select(0, depth))
            return rows.index_copy(3, region, by_position & sees), \
                index[:, earlier:].clone(memory_format=torch.contiguous_format)  # the strides of a chain's

        positions = kwargs["position_ids"][:, :1] + queries[None]
        return {"position_ids": positions, "attention_mask": self.tree_view(view), "past_key_values": self}

    def keep_tree(self, order: torch.Tensor, behind: int = 0) -> None:
        """Gather row 0's region of ``order.numel()`` entries, which starts ``behind`` positions before the row's
        length (0: the forward just run, not yet accepted): region slot ``j`` takes the entry of region slot
        ``order[j]`` (``order`` ``(t,)`` long on the device, the kept entries first) in every buffer a forward
        writes. The caller then moves the row's length with ``accept``. Reads no device value."""
        with self._rewound(behind):
            self.prepare(order.numel(), range(0, 1))
        for buffer, index in self.tree_entries():
            slots = index[0]
            buffer[0].index_copy_(1, slots, buffer[0].index_select(1, slots.index_select(0, order)))

    @contextlib.contextmanager
    def _rewound(self, tokens: int):
        """Row 0's counters (lengths, fills) ``tokens`` back inside the block (the region's start), restored after:
        ``prepare`` then lays a chain over the region."""
        if tokens:
            self.accept(torch.full((1,), -tokens, device=self.lengths.device), [-tokens], range(0, 1))
        try:
            yield
        finally:
            if tokens:
                self.accept(torch.full((1,), tokens, device=self.lengths.device), [tokens], range(0, 1))
