"""What "lossless" promises below fp32 (eval/fidelity.py, the README's table of recipes): in bf16 a speculative
greedy output equals AR's except at near-ties — where it first differs, the target's two tokens are within the
precision's rounding of each other."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama, tiny_neox
from test_decoder import INIT, make_prompt, speculate

from eval.fidelity import agreement, first_divergence
from toolkit.engine.planner import ConstantK
from toolkit.speculative.drafters import LookupDrafter


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers (8 significant bits) around ``x``."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-3))) - 7)


@pytest.mark.parametrize("make", [tiny_llama, tiny_neox])
def test_bf16_speculative_greedy_differs_from_ar_only_at_near_ties(make):
    rows = []
    for seed in range(6):
        target = make(seed=seed, **INIT).to(torch.bfloat16)
        base = make_prompt(seed, length=6)[0]
        prompt = torch.cat([base, base, base[:3]]).view(1, -1)  # repeats: long drafts get verified
        ar, _, _ = speculate(target, None, prompt, max_new_tokens=60)
        ours, stats, _ = speculate(target, LookupDrafter(max_cached_requests=0), prompt, ConstantK(6),
                                   max_new_tokens=60)
        divergence = first_divergence(target, prompt, ar, ours)
        if divergence is not None:
            with torch.no_grad():
                scale = target(prompt).logits[0, -1].float().abs().max().item()
            assert divergence["margin"] <= 4 * bf16_ulp(scale), divergence  # a near-tie, not a wrong token
        rows.append({"identical": ours == ar, "divergence": divergence})
        assert stats.accepted > 0 or seed % 2  # multi-token verifies really ran on most models
    summary = agreement(rows)
    assert summary["identical"] >= 4 and summary["matched_fraction"] > 0.8


def test_first_divergence_and_agreement_summary():
    target = tiny_llama(seed=0, **INIT)
    prompt = make_prompt(0)
    assert first_divergence(target, prompt, [1, 2, 3], [1, 2, 3]) is None
    assert first_divergence(target, prompt, [1, 2, 3], [1, 2]) is None  # a prefix (stopped early) is no divergence
    d = first_divergence(target, prompt, [1, 2, 3, 4], [1, 2, 9, 4])
    with torch.no_grad():
        logits = target(torch.cat([prompt, torch.tensor([[1, 2]])], dim=1)).logits[0, -1]
    assert d["index"] == 2 and d["reference_token"] == 3 and d["ours_token"] == 9 and d["matched_fraction"] == 0.5
    assert d["margin"] == pytest.approx(abs(float(logits[3] - logits[9])), abs=1e-4)
    summary = agreement([{"identical": True, "divergence": None}, {"identical": False, "divergence": d}])
    assert summary == {"identical": 1, "prompts": 2, "matched_fraction": 0.75, "max_divergence_margin": d["margin"]}
