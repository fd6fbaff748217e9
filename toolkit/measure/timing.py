"""Benchmark hygiene helpers: warm-up, device synchronization, repetitions, median with min-max."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass
class Summary:
    """Median, min and max of repeated measurements (``values`` in measurement order)."""

    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        if not values:
            return cls(0.0, 0.0, 0.0, [])
        return cls(statistics.median(values), min(values), max(values), list(values))

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "values": self.values}

    def __str__(self) -> str:
        return f"{self.median:.2f} [{self.min:.2f}-{self.max:.2f}]"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued CUDA work (a no-op on CPU) so wall-clock timings are honest."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def repeat(fn: Callable[[], T], repeats: int = 3, warmup: int = 1) -> list[T]:
    """Call ``fn`` ``warmup`` times (results dropped), then ``repeats`` times; returns the timed results."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


def time_ms(fn: Callable[[], T], device: torch.device | str = "cpu", repeats: int = 5,
            warmup: int = 2) -> tuple[Summary, T]:
    """Milliseconds of ``fn()`` on ``device``: median / min / max of ``repeats`` calls after ``warmup`` calls, and
    the last call's result.

    CUDA: each call is bracketed by ``torch.cuda.Event(enable_timing=True)`` records on the current stream and read
    after ``Event.synchronize``: the stream's timeline from the first record to the second, idle gaps while the host
    prepares work included (what a tok/s figure needs); CPU: ``time.perf_counter`` around the call. Raises
    ``ValueError`` for ``repeats < 1``.
    """
    import time

    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    cuda = torch.device(device).type == "cuda"
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            began = time.perf_counter()
            result = fn()
            times.append((time.perf_counter() - began) * 1000.0)
    return Summary.of(times), result
