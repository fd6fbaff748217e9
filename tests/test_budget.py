"""Time budgets: the protocol is cut in a fixed order until its estimate fits, the timing loops stop starting
repetitions past a deadline, and an evaluation records what was cut."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import tiny_llama

from eval.budget import STEPS, Workload, estimate_s, fit
from eval.evaluate import EvalSettings, evaluate, validate_metrics
from toolkit.measure.harness import Prompt, measure
from toolkit.recipe import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def linear_ms(n: int) -> float:
    """A cost curve: 20 ms + 1 ms per token."""
    return 20.0 + n


def test_fit_cuts_in_order_until_the_estimate_fits():
    settings = EvalSettings.fast()  # 2 prompts, 48 tokens, 3 repetitions, 512 perplexity tokens
    work = Workload(prompt_lens=[40, 60, 80], methods=4, chunk=5, reference=True)
    full = estimate_s(settings, work, linear_ms)
    # one forward per new token: 4 methods x (3 x 2 calls of 48 tokens + a 16-token warm-up) dominate
    assert full == pytest.approx((4 * (3 * (60 + 48 * 21 + 80 + 48 * 21) + (60 + 16 * 21))
                                  + 512 / 5 * 25 + 3 * 276 + 532) / 1000)
    assert fit(settings, work, linear_ms, budget_s=full + 1).cuts == {}  # fits: nothing cut
    fitted = fit(settings, work, linear_ms, budget_s=full / 2)
    assert fitted.estimate_s <= full / 2 < fitted.requested_estimate_s == full
    order = [name for name, _ in STEPS]
    taken = list(fitted.cuts)
    assert taken == sorted(taken, key=order.index)  # in STEPS order, each setting named once with [asked, used]
    assert fitted.cuts["ppl_tokens"][0] == 512 and fitted.settings.ppl_tokens == fitted.cuts["ppl_tokens"][1]
    smallest = fit(settings, work, linear_ms, budget_s=0.001)  # every step taken, and said not to fit
    assert (smallest.settings.max_new_tokens, smallest.settings.repeats, smallest.settings.num_prompts,
            smallest.settings.ppl_tokens) == (16, 1, 1, 128) and not smallest.to_dict()["fits"]


def test_fixed_settings_are_never_cut():
    """A scenario's defining length (new tokens, perplexity text) stays whatever the budget; repetitions and prompts
    are cut instead. A name outside the cuttable settings is refused, naming the field."""
    from toolkit.errors import ConfigError

    settings = EvalSettings.fast(fixed=["max_new_tokens", "ppl_tokens"])
    work = Workload(prompt_lens=[40, 60, 80], methods=4, chunk=5, reference=True)
    smallest = fit(settings, work, linear_ms, budget_s=0.001)
    assert (smallest.settings.max_new_tokens, smallest.settings.ppl_tokens) == (48, 512)
    assert (smallest.settings.repeats, smallest.settings.num_prompts) == (1, 1)
    assert set(smallest.cuts) == {"num_prompts", "repeats"}
    with pytest.raises(ConfigError, match="fixed"):
        EvalSettings.fast(fixed=["ppl_window"])


def test_measure_starts_no_repetition_past_its_deadline():
    calls = []

    def runner(ids, gen):
        calls.append(1)
        time.sleep(0.02)
        from toolkit.measure.harness import Call
        from toolkit.speculative.stats import GenerationStats

        return Call([1], GenerationStats(new_tokens=1, total_ms=20.0))

    prompts = [Prompt("a", "text", torch.tensor([[1, 2]]))]
    from toolkit.recipe import GenerationSpec

    out = measure({"m": runner}, prompts, GenerationSpec(max_new_tokens=1), repeats=5, warmup=0, progress=False,
                  deadline=time.monotonic() + 0.03)
    assert len(out.calls["m"]) == 1 and len(calls) == 1  # the second would end after the deadline
    out = measure({"m": runner}, prompts, GenerationSpec(max_new_tokens=1), repeats=3, warmup=0, progress=False,
                  deadline=time.monotonic() + 60)
    assert len(out.calls["m"]) == 3


def test_evaluation_within_a_budget_says_what_was_cut(tmp_path):
    target = tiny_llama()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (12, 20)]
    recipe = Recipe.from_dict({"name": "tiny-budget", "target": {"device": "cpu"}, "draft": None,
                               "spec": {"drafter": "ngram", "num_draft_tokens": 3},
                               "generation": {"max_new_tokens": 64}})
    settings = EvalSettings.fast(ppl_window=64, ppl_stride=32, baselines=["ar"], time_budget_s=0.05)
    result = evaluate(recipe, settings=settings, out_dir=tmp_path, target=target, tokenizer=None, prompts=prompts,
                      ppl_ids=torch.randint(3, 128, (512,), generator=g).tolist(), progress=False)
    m = result.to_dict()
    validate_metrics(m)
    budget = m["budget"]
    assert m["settings"] == settings.to_dict()  # the settings asked for; what ran is in budget.cuts
    assert budget["cuts"] and budget["requested_estimate_s"] > budget["estimate_s"]
    used = {k: b for k, (_, b) in budget["cuts"].items()}
    assert m["perplexity"]["configured"]["tokens"] <= used.get("ppl_tokens", 512)
    assert m["protocol"]["max_new_tokens"] == used.get("max_new_tokens", 48)
    assert m["protocol"]["repeats"] == budget["repeats_done"] <= used.get("repeats", 3)
    assert "Time budget 0 s" in (tmp_path / "report.md").read_text()


def test_estimates_stay_positive_past_a_curve_that_dips_at_its_end():
    from eval.budget import forward_ms
    from toolkit.speculative.cost_model import VerifyCost

    dipping = VerifyCost([10.0, 12.0, 30.0, 20.0], learn=False)  # learned online: the last point fell
    ms = forward_ms(dipping)
    assert [ms(n) for n in (1, 4, 8, 400)] == [10.0, 20.0, 40.0, 2000.0]  # past the curve: proportional
    assert dipping.ms(400) < 0 < estimate_s(EvalSettings.fast(), Workload([300, 400], 3, 5), ms)
