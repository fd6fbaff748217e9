"""The one measurement harness: warm-up, interleaved repetitions, device sync, medians with min-max.

Every timing in the project goes through :func:`measure` — ``toolkit run --compare``, ``toolkit eval``, the search
and the benchmarks — so they all follow the protocol of ``docs/design.md`` ("Measuring"):

* every method runs on the same prompts with the same :class:`~toolkit.recipe.GenerationSpec`;
* ``warmup`` untimed calls per method first (allocator, kernels, lazy init);
* ``repeats`` repetitions, methods **interleaved** within each repetition and prompt (slow drifts of a shared
  machine hit every method alike); the device is synchronized around every timed call by the runners;
* per repetition, throughput = all new tokens / all wall time over the prompts, TTFT and TPOT = means over the
  prompts; reported as median [min-max] over repetitions (:meth:`Measurement.speed`).

A *runner* is a callable ``(input_ids (1, prompt_len), gen) -> Call``; what it runs (our decoder, an HF baseline)
is the caller's business. The test suite's thread settings (idle OpenMP threads sleep, so a busy 2-core machine
does not stall it) are :func:`toolkit.threads.thread_environment`, applied before torch loads.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from toolkit.cpu import cpu_isa, cpu_line
from toolkit.measure.timing import Summary
from toolkit.recipe import GenerationSpec
from toolkit.speculative.stats import GenerationStats
from toolkit.threads import wait_policy


@dataclass
class Call:
    """One timed call of one method on one prompt.

    Attributes:
        token_ids: the new token ids (prompt excluded).
        stats: counters and timings (ms, bytes) of the call.
        trajectory: optional ``[[new_tokens, elapsed_ms, kv_bytes_target, kv_bytes_draft], ...]`` per round.
        peak: optional peak-memory measurement of the call (see ``eval.metrics.PeakMemory``).
    """

    token_ids: list[int]
    stats: GenerationStats
    trajectory: list | None = None
    peak: dict | None = None


Runner = Callable[[torch.Tensor, GenerationSpec], Call]


@dataclass
class Prompt:
    """A prompt ready to time: an id, a kind (chat, code, ...), its token ids ``(1, prompt_len)`` and the written
    answer its suite gives (``reference``; ``None`` when none)."""

    id: str
    kind: str
    input_ids: torch.Tensor
    reference: str | None = None


def spread(prompts: list, count: int | None) -> list:
    """``count`` prompts taken round-robin over their kinds (chat, summarize, code, ...) in suite order.

    ``None`` or a count >= ``len(prompts)`` keeps them all. Works for any objects with a ``kind`` attribute.
    """
    if count is None or count >= len(prompts):
        return list(prompts)
    return round_robin(prompts)[:count]


def round_robin(prompts: list) -> list:
    """Every prompt, taken round-robin over their kinds in suite order: ``spread(prompts, n)`` is the first ``n``."""
    by_kind: dict[str, list] = {}
    for item in prompts:
        by_kind.setdefault(item.kind, []).append(item)
    picked: list = []
    while len(picked) < len(prompts):
        for group in by_kind.values():
            if group:
                picked.append(group.pop(0))
    return picked


@dataclass
class Measurement:
    """Every call of :func:`measure`: ``calls[method][repetition][prompt]``."""

    methods: list[str]
    prompts: list[Prompt]
    calls: dict[str, list[list[Call]]] = field(default_factory=dict)

    def first(self, method: str) -> list[Call]:
        """The first repetition's calls of ``method``, one per prompt (greedy outputs are the same in every one)."""
        return self.calls[method][0]

    def last(self, method: str) -> list[Call]:
        return self.calls[method][-1]

    def per_prompt(self, method: str, index: int) -> list[Call]:
        """Every repetition's call of ``method`` on prompt ``index``."""
        return [rep[index] for rep in self.calls[method]]

    def speed(self, method: str) -> dict:
        """Throughput (tok/s), TTFT and TPOT (ms) summaries over repetitions, plus the new-token count."""
        throughput, ttft, tpot, tokens = [], [], [], []
        for rep in self.calls[method]:
            n = sum(c.stats.new_tokens for c in rep)
            throughput.append(_throughput(rep))
            ttft.append(sum(c.stats.ttft_ms for c in rep) / len(rep))
            tpot.append(sum(c.stats.tpot_ms for c in rep) / len(rep))
            tokens.append(n)
        return {"throughput": Summary.of(throughput).to_dict(), "ttft_ms": Summary.of(ttft).to_dict(),
                "tpot_ms": Summary.of(tpot).to_dict(), "new_tokens": int(max(tokens) if tokens else 0),
                "repeats": len(self.calls[method])}

    def paired_ratio(self, method: str, baseline: str, key: str = "throughput") -> float | None:
        """Median over repetitions of ``method`` / ``baseline`` within each repetition (both ran under the same
        load), for ``key`` = ``throughput`` (tok/s) or ``tau`` (tokens per round); ``None`` when either is missing."""
        if method not in self.calls or baseline not in self.calls:
            return None
        values = []
        for mine, theirs in zip(self.calls[method], self.calls[baseline]):
            a, b = (_throughput(mine), _throughput(theirs)) if key == "throughput" else (_tau(mine), _tau(theirs))
            if b > 0:
                values.append(a / b)
        return statistics.median(values) if values else None

    def tau(self, method: str) -> float:
        """Median over repetitions of tokens per round τ (committed / rounds over the prompts; an HF baseline
        counts one round per target forward after prefill, see :func:`toolkit.measure.baselines.hf_generate`)."""
        return statistics.median(_tau(rep) for rep in self.calls[method])

    def ratio(self, method: str, baseline: str) -> float | None:
        """Median throughput of ``method`` over that of ``baseline`` (``None`` when either is missing)."""
        if method not in self.calls or baseline not in self.calls:
            return None
        den = self.speed(baseline)["throughput"]["median"]
        return self.speed(method)["throughput"]["median"] / den if den > 0 else None


def _throughput(calls: list[Call]) -> float:
    ms = sum(c.stats.total_ms for c in calls)
    return sum(c.stats.new_tokens for c in calls) / (ms / 1000) if ms > 0 else 0.0


def _tau(calls: list[Call]) -> float:
    rounds = sum(c.stats.rounds for c in calls)
    return sum(c.stats.committed for c in calls) / rounds if rounds else 0.0


def repetitions(repeats: int, deadline: float | None = None) -> Iterator[int]:
    """Repetition indices ``0 .. repeats - 1``; with a ``deadline`` (a ``time.monotonic()`` value), after the first
    none starts that would end past it, at the duration of the one before (a time budget, :mod:`eval.budget`)."""
    started = time.monotonic()
    for rep in range(repeats):
        now = time.monotonic()
        if rep and deadline is not None and now + (now - started) > deadline:
            return
        started = now
        yield rep


def measure(runners: dict[str, Runner], prompts: list[Prompt], gen: GenerationSpec, *, repeats: int = 3,
            warmup: int = 1, warm_gen: GenerationSpec | None = None, meter: Callable | None = None,
            progress: bool = True, desc: str = "measure", rotate: bool = False,
            before_repetition: Callable[[int], None] | None = None, deadline: float | None = None) -> Measurement:
    """Time every runner on every prompt with the protocol above; returns all calls.

    Args:
        runners: ``{method name: runner}``, in table order.
        prompts: what to generate from (non-empty).
        gen: generation settings of the timed calls (same for every method).
        repeats / warmup: timed repetitions (>= 1) and untimed warm-up calls per method (>= 0, on prompt 0).
        warm_gen: settings of the warm-up calls (default ``gen``).
        meter: optional context-manager factory wrapped around each timed call whose ``.result`` becomes
            ``Call.peak`` (peak memory).
        rotate: rotate the method order by one between repetitions (no method always runs first after a prompt
            switch).
        before_repetition: called with the repetition index (0-based) before each timed repetition, after the
            warm-up: e.g. fresh drafter state, so cross-request memory holds only the earlier prompts of this
            repetition and never an earlier repetition of the same prompt.
        deadline: a ``time.monotonic()`` value: after the first repetition, none starts that would end after it (at
            the last repetition's duration); fewer repetitions are then returned (a time budget, :mod:`eval.budget`).

    Raises:
        ValueError: no prompts, no runners, ``repeats < 1`` or ``warmup < 0``.
    """
    from tqdm.auto import tqdm

    if not prompts or not runners:
        raise ValueError("measure: needs at least one prompt and one runner")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"measure: repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    methods = list(runners)
    result = Measurement(methods, list(prompts), {m: [] for m in methods})
    total = len(methods) * (warmup + repeats * len(prompts))
    bar = tqdm(total=total, desc=desc, unit="run", disable=not progress)
    for method in methods:
        for _ in range(warmup):
            runners[method](prompts[0].input_ids, warm_gen or gen)
            bar.update()
    for rep in repetitions(repeats, deadline):
        if before_repetition is not None:
            before_repetition(rep)
        order = methods[rep % len(methods):] + methods[: rep % len(methods)] if rotate else methods
        for m in methods:
            result.calls[m].append([])
        for prompt in prompts:
            for method in order:
                with (meter() if meter is not None else contextlib.nullcontext()) as watch:
                    call = runners[method](prompt.input_ids, gen)
                if meter is not None:
                    call.peak = watch.result
                result.calls[method][-1].append(call)
                bar.set_postfix(prompt=prompt.id, method=method, tok_s=f"{call.stats.throughput:.1f}")
                bar.update()
    done = len(result.calls[methods[0]])
    if done < repeats:
        bar.set_postfix_str(f"time budget: stopped after {done} of {repeats} repetitions")
    bar.close()
    return result


def environment() -> dict:
    """Hardware and library versions, recorded with every result (runs, evaluations, found recipes); on a CPU its
    model and instruction-set flags (:func:`toolkit.cpu.cpu_isa`)."""
    import transformers

    try:
        cpu_count = len(os.sched_getaffinity(0))
    except AttributeError:
        cpu_count = os.cpu_count() or 1
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "machine": platform.machine(), "cpu_count": cpu_count,
            "torch_threads": torch.get_num_threads(), "omp_wait_policy": wait_policy(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:  # its version from the installed metadata: importing it on an AVX-512 CPU logs a kernel-hub warning
        info["bitsandbytes"] = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        info["cpu"] = cpu_isa()
    # what every report's "device" / "Hardware" line prints: the GPU, or the CPU's model, logical CPUs and ISA flags
    info["hardware"] = info.get("gpu") or f"{platform.machine()} CPU: {cpu_line(info['cpu'])}"
    return info
