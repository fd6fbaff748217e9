"""Contract with transformers' cache classes: what toolkit.kv relies on exists and behaves (fails naming it)."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from toolkit.kv import hf_surface
from toolkit.kv.quantized_layer import QuantizedLayer


def test_installed_transformers_has_the_surface_we_use():
    assert hf_surface.surface_problems() == []
    hf_surface.check_surface()


def test_a_moved_attribute_is_named(monkeypatch):
    monkeypatch.delattr(DynamicLayer, "crop")
    monkeypatch.setattr(DynamicLayer, "get_mask_sizes", None)
    with pytest.raises(hf_surface.SurfaceError, match=r"DynamicLayer\.get_mask_sizes is missing") as err:
        hf_surface.check_surface()
    assert "DynamicLayer.crop is missing" in str(err.value)


def test_an_abstract_leftover_is_named(monkeypatch):
    """Removed from DynamicLayer but still declared (abstract) on CacheLayerMixin: caught by behaviour."""
    monkeypatch.delattr(DynamicLayer, "get_mask_sizes")
    with pytest.raises(hf_surface.SurfaceError, match=r"get_mask_sizes\(2\) is \(5, 0\)"):
        hf_surface.check_surface()


def test_a_changed_behaviour_is_named(monkeypatch):
    monkeypatch.setattr(DynamicLayer, "crop", lambda self, n: None)
    with pytest.raises(hf_surface.SurfaceError, match=r"crop\(-1\) drops the newest"):
        hf_surface.check_surface()


def test_quantized_layer_reads_no_lazily_set_dtype(monkeypatch):
    """The 5.24 break: DynamicLayer.lazy_initialization stopped setting .dtype; our layer must not need it."""
    def bare_init(self, key_states, value_states):  # what 5.24 sets, and nothing more
        self.keys = torch.tensor([], dtype=key_states.dtype)
        self.values = torch.tensor([], dtype=value_states.dtype)
        self.is_initialized = True

    monkeypatch.setattr(DynamicLayer, "lazy_initialization", bare_init)
    layer = QuantizedLayer(bits=4, group=4)
    k, v = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16), torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    layer.update(k, v)
    assert layer.commit(sink_tokens=0, boundary=8, evict_before=None)
    out_k, out_v = layer.update(k[:, :, :1], v[:, :, :1])
    assert not hasattr(layer, "dtype") or layer.__dict__.get("dtype") is None
    assert out_k.dtype == torch.bfloat16 and out_k.shape == (1, 2, 9, 4) and out_v.shape == (1, 2, 9, 4)
    assert (out_k[:, :, :8] - k).abs().max() < 0.5  # 4-bit groups of the committed 8 tokens, then the new one
