"""Every registered KV policy and its cache keep the declared contract (toolkit/kv/contract.py), as do the plain
cache and the EAGLE head's cache; the decode loop only calls what the contract declares."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_forward, tiny_llama

from toolkit.eagle.head import HeadCache
from toolkit.kv import COMPOSED, POLICIES, make_policy
from toolkit.kv.contract import CacheProtocol, KVPolicyProtocol, MemoryReport, PlainCache, new_cache, policy_attached
from toolkit.recipe import KVSpec

PARAMS = {"streaming": {"sink_tokens": 4, "window": 24}, "l2norm": {"budget": 16, "protect_recent": 4},
          "head_aware": {"budget": 16, "protect_recent": 4},
          "quantized": {"quant_bits": 4, "quant_group_size": 16, "residual_length": 8}}


def _policies() -> list:
    make_policy(KVSpec("none"))  # loads the built-in policies
    out = [(name, KVSpec(name, PARAMS.get(name, {}))) for name in sorted(POLICIES)
           if POLICIES[name].torch_form]  # llama.cpp's own KV formats: tests/test_llamacpp_backend.py
    out += [(f"{name}+quant", KVSpec(name, {**PARAMS.get(name, {}), "quant_bits": 4, "quant_group_size": 16,
                                            "residual_length": 8})) for name in sorted(COMPOSED)]
    return out


@pytest.mark.parametrize("name,spec", _policies(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_policy_and_its_cache_keep_the_contract(name, spec):
    model = tiny_llama(seed=0)
    policy = make_policy(spec)
    assert isinstance(policy, KVPolicyProtocol)
    cache = new_cache(policy, model)
    assert isinstance(cache, CacheProtocol)
    with policy_attached(policy, model), torch.no_grad():
        ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        hf_forward(model, input_ids=ids, past_key_values=cache, use_cache=True, **cache.forward_kwargs(torch.arange(40)[None]))
        cache.commit()
        before = cache.get_seq_length()
        hf_forward(model, input_ids=ids[:, :3], past_key_values=cache, use_cache=True,
              **cache.forward_kwargs(torch.arange(before, before + 3)[None]))
        cache.crop(-2)
    assert cache.get_seq_length() == before + 1 and cache.kv_bytes() > 0 and cache.compressions >= 0


def test_plain_cache_rolls_back_and_counts_bytes():
    model = tiny_llama(seed=0)
    cache = new_cache(None, model)
    assert isinstance(cache, PlainCache) and isinstance(cache, CacheProtocol)
    with torch.no_grad():
        hf_forward(model, input_ids=torch.arange(10)[None], past_key_values=cache, use_cache=True,
              **cache.forward_kwargs(torch.arange(10)[None]))
        cache.commit()
        keys = cache.layers[0].keys.clone()
        hf_forward(model, input_ids=torch.arange(4)[None], past_key_values=cache, use_cache=True,
              **cache.forward_kwargs(torch.arange(10, 14)[None]))
    cache.crop(-2)
    assert cache.get_seq_length() == 12 and torch.equal(cache.layers[0].keys[:, :, :10], keys)
    layers = model.config.num_hidden_layers
    assert cache.kv_bytes() == 2 * layers * 12 * 2 * 16 * 4  # keys+values x layers x tokens x heads x dim x fp32


def test_eagle_head_cache_reports_memory():
    cache = HeadCache()
    assert isinstance(cache, MemoryReport) and cache.kv_bytes() == 0
    cache.append(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    assert cache.kv_bytes() == 2 * 2 * 5 * 8 * 4 and cache.compressions == 0
