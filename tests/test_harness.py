"""The measurement harness: call order (warm-up, interleaving, rotation, per-repetition setup) and the summaries it
computes from the calls (exact values from fake runners with fixed timings; no wall-clock assertions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from toolkit.measure.harness import Call, Prompt, environment, measure
from toolkit.recipe import GenerationSpec
from toolkit.speculative.stats import GenerationStats

GEN = GenerationSpec(max_new_tokens=8)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", "chat", torch.tensor([[1, 2, 3 + i]])) for i in range(n)]


def _fake(name: str, log: list, ms_per_call: float, rounds: int, committed: int):
    """A runner that logs ``(name, prompt's last id, max_new_tokens)`` and reports fixed stats."""

    def run(input_ids, gen):
        log.append((name, int(input_ids[0, -1]), gen.max_new_tokens))
        stats = GenerationStats(new_tokens=gen.max_new_tokens, total_ms=ms_per_call, rounds=rounds,
                                committed=committed)
        return Call([0] * gen.max_new_tokens, stats)

    return run


def test_calls_are_warmed_up_interleaved_rotated_and_set_up_per_repetition():
    log: list = []
    runners = {m: _fake(m, log, 10.0, 4, 8) for m in ("a", "b", "c")}
    marks: list = []
    measure(runners, _prompts(2), GEN, repeats=3, warmup=1, warm_gen=GenerationSpec(max_new_tokens=2),
            progress=False, rotate=True, before_repetition=lambda rep: (marks.append((rep, len(log)))))
    warm, timed = log[:3], log[3:]
    assert warm == [("a", 3, 2), ("b", 3, 2), ("c", 3, 2)]  # every method warmed on prompt 0 with warm_gen
    assert marks == [(0, 3), (1, 9), (2, 15)]  # set-up runs after the warm-up, before each repetition
    orders = [[name for name, _, _ in timed[i:i + 3]] for i in range(0, len(timed), 3)]
    assert orders == [["a", "b", "c"]] * 2 + [["b", "c", "a"]] * 2 + [["c", "a", "b"]] * 2
    prompts_seen = [pid for _, pid, _ in timed]
    assert prompts_seen == [3, 3, 3, 4, 4, 4] * 3  # per prompt, every method back to back
    log.clear()
    measure(runners, _prompts(1), GEN, repeats=2, warmup=0, progress=False)  # no rotation by default
    assert [name for name, _, _ in log] == ["a", "b", "c", "a", "b", "c"]


def test_summaries_and_ratios_are_computed_from_the_calls():
    log: list = []
    runners = {"ours": _fake("ours", log, 100.0, 2, 8), "ar": _fake("ar", log, 400.0, 7, 7)}
    m = measure(runners, _prompts(2), GEN, repeats=2, warmup=0, progress=False)
    assert m.speed("ours")["throughput"]["median"] == pytest.approx(80.0)  # 16 tokens / 0.2 s
    assert m.speed("ar")["throughput"]["median"] == pytest.approx(20.0)
    assert m.paired_ratio("ours", "ar") == pytest.approx(4.0) == m.ratio("ours", "ar")
    assert m.tau("ours") == pytest.approx(4.0) and m.tau("ar") == pytest.approx(1.0)
    assert m.paired_ratio("ours", "ar", key="tau") == pytest.approx(4.0)
    assert m.paired_ratio("ours", "missing") is None


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="at least one prompt"):
        measure({"a": _fake("a", [], 1.0, 1, 1)}, [], GEN)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure({"a": _fake("a", [], 1.0, 1, 1)}, _prompts(1), GEN, repeats=0)


def test_a_cpu_decode_warns_once_under_a_passive_openmp_wait(monkeypatch, caplog):
    """OMP_WAIT_POLICY=PASSIVE halves a CPU decode's speed on a quiet machine: one warning per process, none when
    unset, and every result's environment records the policy."""
    import logging

    from toolkit import threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads.warn_passive_wait.cache_clear()
    assert threads.wait_policy() == "default" and not threads.warn_passive_wait()
    assert environment()["omp_wait_policy"] == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    threads.warn_passive_wait.cache_clear()
    with caplog.at_level(logging.WARNING, logger="toolkit.threads"):
        assert threads.warn_passive_wait()
        threads.warn_passive_wait()
    warned = [r.getMessage() for r in caplog.records if r.name == "toolkit.threads"]
    assert len(warned) == 1 and warned[0].startswith("OMP_WAIT_POLICY=PASSIVE")
    assert environment()["omp_wait_policy"] == "passive"
    threads.warn_passive_wait.cache_clear()


def test_cpu_figures_state_the_machines_isa_from_lscpu_or_proc_cpuinfo(monkeypatch):
    """Every CPU result records the CPU's model and instruction-set flags (``environment()["cpu"]``); without
    ``lscpu`` the same flags come from ``/proc/cpuinfo``."""
    import subprocess

    from toolkit import cpu as machine

    machine._cpu_fields.cache_clear()
    cpu = machine.cpu_isa()
    assert cpu["model"] and set(cpu["flags"]) <= set(machine.CPU_ISA_FLAGS)
    assert list(cpu["flags"]) == [f for f in machine.CPU_ISA_FLAGS if f in cpu["flags"]]  # in the table's order
    assert environment()["cpu"] == cpu and machine.cpu_line(cpu).startswith(cpu["model"])

    def missing(*args, **kwargs):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(subprocess, "run", missing)
    machine._cpu_fields.cache_clear()
    try:
        fallback = machine.cpu_isa()
    finally:
        machine._cpu_fields.cache_clear()
    if Path("/proc/cpuinfo").exists():
        assert fallback["flags"] == cpu["flags"] and fallback["model"] != "?"
    else:
        assert fallback["flags"] == [] and fallback["model"] == "?"


def test_environment_reads_library_versions_without_importing_them(monkeypatch):
    """bitsandbytes' version comes from its installed metadata: importing it on an AVX-512 CPU logged a warning about
    an optional kernel hub into every run's output (make short, toolkit eval)."""
    import importlib.metadata
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import would now fail
    assert environment()["bitsandbytes"] == importlib.metadata.version("bitsandbytes")
