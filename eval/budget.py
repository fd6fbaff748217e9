"""Fitting a measurement into a time budget, whatever the model's size.

An evaluation's work grows with the model: on a 2-core CPU a 0.5B target decodes ~10x slower than the embedded
135M one, and the fast protocol (2 prompts x 48 tokens x 3 repetitions x every baseline, 512 perplexity tokens) that
takes a minute there takes ten here. :func:`fit` estimates the work of a protocol from the target's measured verify
cost curve (:mod:`toolkit.speculative.cost_model`: milliseconds of a forward over ``n`` new tokens) and cuts it, one
step at a time in a fixed order, until the estimate fits the budget:

    perplexity tokens 512 -> 256, new tokens -> 32, per-request prompts -> 1, new tokens -> 24, perplexity tokens ->
    128, repetitions -> 2, new tokens -> 16, repetitions -> 1

A setting named in ``EvalSettings.fixed`` is skipped: what defines a scenario (the long-prompt spaces' new tokens
and perplexity text) is never cut, only repetitions and prompts.

The estimate counts every call a protocol makes: per method and prompt a prefill of the prompt plus one forward per
new token (an upper bound for speculative methods, exact for AR), the warm-up calls, the perplexity passes (through
the cache in chunks of K + 1, the sliding window, the fp32 reference) and the batch stage. What was cut, the estimate
and the budget go into the results (``metrics.json`` ``budget``) and the report, so a cut protocol is never mistaken
for the full one. The timing loop also stops starting repetitions when the next would overrun
(:func:`toolkit.measure.harness.measure`, ``deadline``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: the cuts, in the order they are made: (setting, value after the cut)
STEPS = (("ppl_tokens", 256), ("max_new_tokens", 32), ("num_prompts", 1), ("max_new_tokens", 24),
         ("ppl_tokens", 128), ("repeats", 2), ("max_new_tokens", 16), ("repeats", 1))
#: the settings a cut can touch (``EvalSettings.fixed`` names those it must not)
CUTTABLE = tuple(dict.fromkeys(name for name, _ in STEPS))


@dataclass
class Workload:
    """What a protocol runs, besides its settings: prompt lengths (tokens) of the per-request and batch stages, the
    timed methods of each, the perplexity chunk (K + 1) and whether a separate fp32 reference is scored."""

    prompt_lens: list[int]
    methods: int
    chunk: int
    reference: bool = False
    batch_prompt_lens: list[int] = field(default_factory=list)
    batch_methods: int = 0
    batch_size: int = 1


@dataclass
class Fitted:
    """The settings to run, the estimate (s) of their work and of the requested protocol's, and the cuts made
    (``{setting: [requested, used]}``)."""

    settings: object
    estimate_s: float
    requested_estimate_s: float
    budget_s: float
    cuts: dict[str, list]
    work: Workload

    def to_dict(self) -> dict:
        return {"time_budget_s": self.budget_s, "estimate_s": round(self.estimate_s, 1),
                "requested_estimate_s": round(self.requested_estimate_s, 1), "cuts": self.cuts,
                "fits": self.estimate_s <= self.budget_s}


def forward_ms(cost) -> Callable[[int], float]:
    """``ms(n)`` of a cost curve for any ``n``: the curve where it was measured, past it proportional to its last
    point (a curve learned online can dip at its end, and extrapolating that slope would go negative)."""
    def ms(n: int) -> float:
        return cost.ms(n) if n <= cost.max_tokens else cost.step_ms[-1] * n / cost.max_tokens

    return ms


def timing_s(prompt_lens: list[int], methods: int, new_tokens: int, repeats: int, warmup: int, ms) -> float:
    """Seconds of timing ``methods`` over prompts of ``prompt_lens`` tokens: a prefill and one forward per new token
    per call (AR; speculative methods take fewer forwards, so this bounds them), ``warmup`` 16-token calls first."""
    def call(prompt_len: int, tokens: int) -> float:
        return ms(prompt_len) + tokens * ms(1)

    return methods * (warmup * call(prompt_lens[0], min(16, new_tokens))
                      + repeats * sum(call(n, new_tokens) for n in prompt_lens)) / 1000.0


def estimate_s(settings, work: Workload, ms) -> float:
    """Seconds the protocol ``settings`` needs for ``work`` at ``ms(n)`` milliseconds per forward of n tokens."""
    prompts = work.prompt_lens[: settings.num_prompts] if settings.num_prompts else work.prompt_lens
    new = settings.max_new_tokens or 128
    timing = 1000.0 * timing_s(prompts, work.methods, new, settings.repeats, settings.warmup, ms)
    ppl = settings.ppl_tokens
    window = min(settings.ppl_window, ppl)
    windows = max(1, -(-(ppl - window) // max(1, settings.ppl_stride)) + 1)
    perplexity = (ppl / work.chunk) * ms(work.chunk) + windows * ms(window) + (ms(ppl) if work.reference else 0.0)
    batch = 0.0
    if work.batch_methods:  # every row's forwards are shared: ~ rows x tokens per forward of the batch
        rows = min(work.batch_size, len(work.batch_prompt_lens))
        per_call = sum(ms(n) for n in work.batch_prompt_lens) + len(work.batch_prompt_lens) / rows * new * ms(rows)
        batch = work.batch_methods * (settings.repeats + 1) * per_call
    return (timing + perplexity + batch) / 1000.0


def fit(settings, work: Workload, ms, budget_s: float, min_prompts: int = 1) -> Fitted:
    """Cut ``settings`` (an :class:`eval.evaluate.EvalSettings`) step by step (:data:`STEPS`) until its estimate is
    at most ``budget_s`` seconds, or every step is taken; returns the settings to run and what was cut. The prompt
    cut stops at ``min_prompts`` (the prompts that keep ``settings.keep_kinds``, e.g. a summarization prompt);
    settings in ``settings.fixed`` are never cut."""
    requested = estimate_s(settings, work, ms)
    current, cuts = settings, {}
    fixed = set(getattr(settings, "fixed", None) or ())
    for name, value in STEPS:
        if estimate_s(current, work, ms) <= budget_s:
            break
        if name in fixed:
            continue
        if name == "num_prompts":
            value = max(value, min_prompts)
        before = getattr(current, name)
        if before is not None and before <= value:
            continue
        current = dataclasses.replace(current, **{name: value})
        cuts[name] = [cuts.get(name, [before])[0], value]
    return Fitted(current, estimate_s(current, work, ms), requested, budget_s, cuts, work)


def fit_evaluation(recipe, settings, generator, prompts: list, batch_prompts: list, reference_model) -> Fitted:
    """:func:`fit` for one evaluation (:func:`eval.evaluate.evaluate`): its timed methods (ours + the applicable
    baselines), its prompts (``(1, n)`` token ids in ``.input_ids``), its batch stage and the target's cost curve
    (``generator.verify_cost``); logs what was cut."""
    from eval.batch_run import batch_methods
    from eval.quality import keep_count
    from eval.runners import selected_baselines
    from toolkit.measure.harness import round_robin

    separate = reference_model is not None and reference_model is not generator.target
    methods = selected_baselines(recipe, separate, settings.baselines, generator.target)
    longest = recipe.generation.max_new_tokens
    ordered = round_robin(prompts)  # the order the per-request stage takes them in (spread)
    work = Workload([int(p.input_ids.shape[1]) for p in ordered], 1 + len(methods), recipe.spec.num_draft_tokens + 1,
                    separate, [int(p.input_ids.shape[1]) for p in batch_prompts],
                    len(batch_methods(settings.baselines)) if batch_prompts else 0, recipe.batch_size or 1)
    fitted = fit(dataclasses.replace(settings, max_new_tokens=min(longest, settings.max_new_tokens or longest)),
                 work, forward_ms(generator.verify_cost), settings.time_budget_s,
                 min_prompts=keep_count(prompts, 1, settings.keep_kinds) or 1)
    if fitted.cuts:
        log.warning("eval %s: cut to fit the %.0f s budget (estimate %.0f s -> %.0f s): %s", recipe.name,
                    settings.time_budget_s, fitted.requested_estimate_s, fitted.estimate_s,
                    ", ".join(f"{k} {a} -> {b}" for k, (a, b) in fitted.cuts.items()))
    return fitted


def timing_deadline(deadline: float | None, fitted: Fitted | None, settings, curve: Callable) -> float | None:
    """When the per-request timing loop must stop starting repetitions: the budget's end less the batch stage still
    to come (its share of the estimate). ``curve()`` gives the target's cost curve, read only when a batch stage's
    share is taken off (without a budget it is never measured)."""
    if deadline is None or fitted is None or not fitted.work.batch_methods:
        return deadline
    ms = forward_ms(curve())
    without_batch = estimate_s(settings, dataclasses.replace(fitted.work, batch_methods=0), ms)
    return deadline - (estimate_s(settings, fitted.work, ms) - without_batch)
