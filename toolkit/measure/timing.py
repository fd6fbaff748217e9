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
