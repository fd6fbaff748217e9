"""What the toolkit's caches rely on from transformers' cache classes, checked in one place.

Every cache in :mod:`toolkit.kv` and the batch caches subclass ``transformers.cache_utils.DynamicLayer`` /
``DynamicCache`` or build a ``Cache`` from layers. They may use only the documented surface of ``Cache`` and
``CacheLayerMixin``, listed here; anything a transformers release sets lazily or privately (e.g. ``DynamicLayer.dtype``,
which 5.24 stopped setting) is the toolkit's own business to record. :func:`check_surface` checks the list against
the installed transformers, by name *and* by behaviour on a tiny tensor, and names whatever moved; the contract test
(``tests/test_hf_surface.py``) calls it, so an upgrade that changes what we rely on fails with the attribute's name
instead of deep inside a decode.
"""

from __future__ import annotations

import inspect

import torch

#: methods every layer class we subclass must have (``CacheLayerMixin``'s abstract surface + ``crop``); ``reset`` is
#: not among them: no toolkit cache is ever reset (5.14 zeroes a layer, 5.24 drops its tensors)
LAYER_METHODS = ("lazy_initialization", "update", "get_seq_length", "get_mask_sizes", "get_max_length", "crop")
#: instance attributes ``CacheLayerMixin.__init__`` sets and we read / assign
LAYER_ATTRIBUTES = ("keys", "values", "is_initialized")
#: methods of ``Cache`` / ``DynamicCache`` our caches call or override
CACHE_METHODS = ("update", "get_seq_length", "get_mask_sizes", "crop")
#: keyword arguments of constructors we call: ``Cache(layers=...)``, ``DynamicCache(config=...)``
CONSTRUCTOR_KWARGS = {"Cache": ("layers",), "DynamicCache": ("config",)}


class SurfaceError(RuntimeError):
    """The installed transformers lacks (or changed) something in the surface above; the message names it."""


def surface_problems() -> list[str]:
    """Every way the installed transformers differs from what the toolkit relies on (empty when all is well)."""
    from transformers import __version__
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    where = f"transformers {__version__}"
    problems = [f"{where}: DynamicLayer.{name} is missing" for name in LAYER_METHODS
                if not callable(getattr(DynamicLayer, name, None))]
    problems += [f"{where}: DynamicCache.{name} is missing" for name in CACHE_METHODS
                 if not callable(getattr(DynamicCache, name, None))]
    for cls in (Cache, DynamicCache):
        params = inspect.signature(cls.__init__).parameters
        problems += [f"{where}: {cls.__name__}.__init__ no longer takes {kw}="
                     for kw in CONSTRUCTOR_KWARGS[cls.__name__] if kw not in params]
    layer = DynamicLayer()
    problems += [f"{where}: DynamicLayer() no longer sets .{name}" for name in LAYER_ATTRIBUTES
                 if not hasattr(layer, name)]
    if problems:
        return problems
    return _behaviour_problems(where, DynamicLayer(), Cache)


def _behaviour_problems(where: str, layer, cache_cls) -> list[str]:
    """update / crop / get_seq_length / get_mask_sizes on a ``(1, 2, 3, 4)`` state, as our caches expect."""
    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    checks = [
        ("a new DynamicLayer says is_initialized=False", lambda: not layer.is_initialized),
        ("DynamicLayer.update stores (batch, heads, seq, head_dim) in .keys/.values and returns them",
         lambda: torch.equal(layer.update(keys, values)[0], keys) and layer.is_initialized
         and tuple(layer.keys.shape) == (1, 2, 3, 4)),
        ("DynamicLayer.get_seq_length() is 3 after 3 tokens", lambda: layer.get_seq_length() == 3),
        ("DynamicLayer.get_mask_sizes(2) is (5, 0)", lambda: tuple(layer.get_mask_sizes(2)) == (5, 0)),
        ("DynamicLayer.crop(-1) drops the newest entry of .keys/.values",
         lambda: layer.crop(-1) is None and torch.equal(layer.values, values[:, :, :2])),
        ("Cache(layers=[...]) holds our layer objects in .layers",
         lambda: cache_cls(layers=[layer]).layers[0] is layer),
    ]
    out = []
    for expectation, check in checks:
        try:
            ok, error = bool(check()), ""
        except Exception as exc:  # noqa: BLE001 - any failure is reported by name
            ok, error = False, f" ({type(exc).__name__}: {exc})"
        if not ok:
            out.append(f"{where}: expected: {expectation}{error}")
            break  # later checks build on this one
    return out


def check_surface() -> None:
    """Raise :class:`SurfaceError` naming every attribute or behaviour of transformers' caches that moved."""
    problems = surface_problems()
    if problems:
        raise SurfaceError("the toolkit's caches rely on transformers internals that changed:\n  "
                           + "\n  ".join(problems))
