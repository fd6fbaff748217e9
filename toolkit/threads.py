"""Thread settings: the test suite's for shared machines (applied before torch loads OpenMP, so this module never
imports torch), and the warning a decode on a CPU gives where those settings would slow it down."""

from __future__ import annotations

import functools
import logging
import os

#: OpenMP settings for shared machines: idle threads sleep instead of spinning (measured: ``make test`` took 17 min
#: instead of 2.25 while another job ran with the default active wait policy).
THREAD_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}

#: what the passive wait costs a decode on a quiet machine (2-core AMD EPYC with AVX-512, 2026-11-27): a compiled
#: int4 verify forward of the embedded model 11.2-11.9 -> 23.8-25.1 ms a round, a llama.cpp one-token decode on the
#: same GGUF 8-12.5 -> 25-32 ms. Both run their kernels in OpenMP parallel regions (ggml's per-operation barrier is
#: an OpenMP barrier), and a passive barrier puts the waiting thread to sleep at each of a step's hundreds of them.
PASSIVE_COST = ("compiled int4 decode rounds 2.1x slower, llama.cpp one-token decodes 2.5-4x slower, measured on a "
                "quiet 2-core CPU")

log = logging.getLogger(__name__)


def thread_environment() -> None:
    """Apply :data:`THREAD_ENVIRONMENT` to ``os.environ`` unless the user set them; effective before torch loads."""
    for key, value in THREAD_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def wait_policy() -> str:
    """OpenMP's wait policy as the environment sets it (``passive``, ``active``, or ``default``: unset); read by
    the OpenMP runtimes when they load, recorded with every result."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() or "default"


@functools.cache
def warn_passive_wait() -> bool:
    """Log one warning per process when a CPU decode runs under ``OMP_WAIT_POLICY=PASSIVE`` (see
    :data:`PASSIVE_COST`); returns whether it warned. Worth it only where other processes compete for the cores."""
    if wait_policy() != "passive":
        return False
    log.warning("OMP_WAIT_POLICY=PASSIVE is set: every OpenMP barrier of a decode step sleeps (%s); unset it unless "
                "other processes compete for these cores", PASSIVE_COST)
    return True
