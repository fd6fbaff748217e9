"""The GPU benchmark kit on the CPU: its dry run end to end, the relay of large files in parts, carried wheels, and
every CUDA branch that can run without a GPU (CUDA-event timing, peak device memory, torchao's CUDA configs, the
backend choice on CUDA), each by faking the device; plus ``scripts/install_torch.sh`` staying offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_kit import carry  # noqa: E402
from gpu_kit.checks import chi_square_p  # noqa: E402


@pytest.mark.slow
@pytest.mark.system
def test_dry_run_runs_every_stage_and_writes_its_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_bench.py"), "--dry-run", "--out", str(out),
                           "--carry", str(tmp_path / "no-carry")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_bench.json", "gpu_bench.log", "gpu_bench.md"]
    assert "GPU kit summary" in done.stdout.splitlines()[-12:][0] or "GPU kit summary" in done.stdout
    stages = json.loads((out / "gpu_bench.json").read_text())["stages"]
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(
        ["environment", "greedy", "verify_cost", "speed", "speed_real", "sampling", "kv", "projection",
         "verify_cost_more"], "ok")
    assert stages["greedy"]["result"]["all_identical"]
    batch = [r["path"] for r in stages["greedy"]["result"]["rows"] if r["path"].startswith("batch of 8")]
    assert len([p for p in batch if p.startswith("batch of 8, lookup: row")]) == 8  # eager
    assert len([p for p in batch if p.startswith("batch of 8, lookup, compiled")]) == 8  # the dry run's traced
    assert stages["kv"]["result"]["all_equal"]
    kv = {r["policy"]: r for r in stages["kv"]["result"]["rows"]}
    assert set(kv) == {"streaming", "l2norm", "head_aware", "quantized"}
    # each policy compressed; StreamingLLM (absolute positions, exact window) runs on the static cache's ring, which
    # drops positions by overwriting their slots, never by compressing
    assert all(r["compressions"] > 0 for name, r in kv.items() if name != "streaming")
    assert kv["streaming"]["compressions"] == 0 and kv["streaming"]["kv_bytes"] > 0
    assert stages["sampling"]["result"]["p_value"] > 0.01 and stages["sampling"]["result"]["drafted"] > 0
    speed = stages["speed"]["result"]["tiny"]["rows"]
    assert {"HF AR", "HF static cache + compiled AR", "ours AR", "ours EAGLE-1 head (K=3)"} <= set(speed)
    assert all(r.get("tok_s", 0) > 0 and "error" not in r for r in speed.values()), speed
    curve = stages["verify_cost"]["result"]["tiny"]["batches"]
    assert set(curve) == {"1", "2"} and all(ms > 0 for ms in curve["1"]["ms"].values())
    assert stages["projection"]["result"]["tiny"], "no projection from the committed CPU reports"
    real = stages["speed_real"]["result"]  # the embedded model on the repeated-request suite
    assert real["requests"] == 2 and set(real["rows"]) == {"HF prompt lookup (K=10)", "ours AR",
                                                            "ours lookup (cost-aware K)"}  # eager in the dry run
    assert all(r["tok_s"] > 0 and "error" not in r for r in real["rows"].values()), real["rows"]
    lookup = real["rows"]["ours lookup (cost-aware K)"]  # real weights: the lookup drafter is accepted
    assert lookup["alpha"] > 0 and lookup["tau"] > 1.0 and real["rows"]["ours AR"]["tau"] == 1.0
    assert "| ours AR |" in (out / "gpu_bench.md").read_text()


def test_a_failing_stage_is_recorded_and_the_next_runs_in_the_order_given(tmp_path, monkeypatch):
    import gpu_bench
    from gpu_kit import checks

    monkeypatch.setattr(checks, "sampling", lambda kit: 1 / 0)
    code = gpu_bench.main(["--dry-run", "--out", str(tmp_path), "--carry", str(tmp_path / "none"),
                           "--stages", "projection", "environment", "sampling", "projection"])
    stages = json.loads((tmp_path / "gpu_bench.json").read_text())["stages"]
    assert code == 1
    assert list(stages) == ["projection", "environment", "sampling"]  # as given (not STAGES' order), each once
    assert stages["sampling"]["status"] == "failed" and "ZeroDivisionError" in stages["sampling"]["error"]
    assert stages["projection"]["status"] == "ok" and "greedy" not in stages


def test_bad_arguments_name_the_field(tmp_path, capsys):
    import gpu_bench

    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--out", str(tmp_path), "--budget-s", "0"])
    assert "--budget-s: must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--out", str(tmp_path), "--stages", "warp-speed"])
    for bad in ("weights", "weights=0", "warp=10", "weights=soon"):
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(["--out", str(tmp_path), "--stage-s", bad])
        assert "--stage-s: expected STAGE=SECONDS" in capsys.readouterr().err
    assert gpu_bench.parse_args(["--out", str(tmp_path), "--stage-s", "weights=90"]).stage_caps == {"weights": 90.0}


def test_a_stage_cap_stops_that_stage_only(tmp_path):
    import gpu_bench

    kit = gpu_bench.make_kit(gpu_bench.parse_args(["--out", str(tmp_path), "--dry-run", "--stage-s", "weights=0.05"]),
                             log=lambda line: None)
    kit.begin_stage("weights")
    assert not kit.out_of_time("a row") and 0 < kit.time_left() <= 0.05
    time.sleep(0.06)
    assert kit.out_of_time("a row")  # its cap is spent ...
    kit.begin_stage("kv_long")
    assert not kit.out_of_time("a row") and kit.time_left() > 400  # ... the next stage has the budget's time


# ------------------------------------------------------------------------------------------------ relay, wheels
def test_split_and_join_restore_the_file_and_catch_a_stale_part(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(100_003))
    parts = carry.split_file(src, tmp_path / "parts", 3)
    assert [p.stat().st_size for p in parts] == [33_335, 33_335, 33_333]
    joined = carry.join_parts(tmp_path / "parts", tmp_path / "joined")
    assert joined.read_bytes() == src.read_bytes()
    mtime = joined.stat().st_mtime_ns
    assert carry.join_parts(tmp_path / "parts", tmp_path / "joined").stat().st_mtime_ns == mtime  # reused
    parts[1].write_bytes(b"x" * 33_335)
    with pytest.raises(ValueError, match="differs from the manifest"):
        carry.join_parts(tmp_path / "parts", tmp_path / "joined2")
    parts[2].unlink()
    with pytest.raises(FileNotFoundError, match=r"model.gguf.part2"):
        carry.join_parts(tmp_path / "parts", tmp_path / "joined3")


def _wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/METADATA", f"{info}/WHEEL",
                                                                     f"{info}/RECORD"]))
    return path


def test_wheels_load_when_carried_and_are_named_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(carry, "OPTIONAL", {"torch": "torch", "kitprobe": "kitprobe", "kitabsent": "kitabsent"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    _wheel(tmp_path, "kitprobe", "1.2", {"kitprobe/__init__.py": b"VALUE = 42\n"})
    lines = []
    status = carry.load_wheels(tmp_path, log=lines.append)
    assert status["torch"].startswith("preinstalled ")
    assert status["kitprobe"] == "carried 1.2"
    assert status["kitabsent"].startswith("missing: no kitabsent installed and no kitabsent-*.whl")
    assert any(line.startswith("skip kitabsent:") for line in lines)
    import kitprobe

    assert kitprobe.VALUE == 42


def test_bitsandbytes_is_trimmed_to_one_cuda_library(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_carry import trim_bitsandbytes

    libs = {f"bitsandbytes/libbitsandbytes_{k}.so": b"\0" * 10 for k in ("cpu", "cuda126", "cuda130", "rocm70")}
    wheel = _wheel(tmp_path, "bitsandbytes", "0.50.2", {"bitsandbytes/__init__.py": b"", **libs})
    trim_bitsandbytes(wheel, "130")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        record = whl.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert {n for n in names if n.endswith(".so")} == {"bitsandbytes/libbitsandbytes_cpu.so",
                                                       "bitsandbytes/libbitsandbytes_cuda130.so"}
    assert "cuda126" not in record and "cuda130" in record
    with pytest.raises(SystemExit, match="no libbitsandbytes_cuda999.so"):
        trim_bitsandbytes(wheel, "999")


def test_chi_square_p_matches_scipy():
    from scipy.stats import chisquare

    counts = torch.tensor([30.0, 52, 18, 100, 3, 1])  # 204 draws: the last two cells expect 4.08 each (< 5)
    probs = torch.tensor([0.15, 0.25, 0.1, 0.46, 0.02, 0.02])
    pooled_counts, pooled_expected = [30, 52, 18, 100, 4], [30.6, 51.0, 20.4, 93.84, 8.16]
    assert chi_square_p(counts, probs) == pytest.approx(chisquare(pooled_counts, pooled_expected).pvalue, rel=1e-6)


# ------------------------------------------------------------------------------------------------ CUDA branches
class _FakeEvent:
    clock = 0.0  # the fake stream's time: only the timed function advances it

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.at - self.at


def test_time_ms_uses_cuda_events_on_cuda(monkeypatch):
    from toolkit.measure.timing import time_ms

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    calls = []

    def work():  # 7.5 ms of queued work per call, on the fake stream
        _FakeEvent.clock += 7.5
        calls.append(1)
        return len(calls)

    summary, result = time_ms(work, "cuda", repeats=3, warmup=1)
    assert summary.values == [7.5, 7.5, 7.5] and result == 4  # 0.0 if the work ran outside the two records
    cpu, _ = time_ms(lambda: None, "cpu", repeats=2, warmup=0)
    assert len(cpu.values) == 2 and all(0 <= v < 50 for v in cpu.values)
    with pytest.raises(ValueError, match="repeats: must be >= 1"):
        time_ms(lambda: None, "cpu", repeats=0)


def test_peak_memory_reads_the_cuda_allocator(monkeypatch):
    from eval.metrics import PeakMemory

    state = {"reset": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: state.update(reset=state["reset"] + 1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 8192)
    with PeakMemory("cuda") as meter:
        pass
    assert state["reset"] == 1
    assert meter.result == {"device": "cuda", "peak_allocated_bytes": 5000, "peak_reserved_bytes": 8192,
                            "peak_growth_bytes": 4000}


@pytest.mark.parametrize("capability", [(9, 0), (7, 5)])
def test_torchao_int4_config_on_cuda(monkeypatch, capability):
    pytest.importorskip("torchao")
    from toolkit.errors import ConfigError
    from toolkit.models.spec import ModelSpec
    from toolkit.quant import choose_backend
    from toolkit.quant.torchao import compute_dtype, config_for

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    cuda = torch.device("cuda")
    spec = ModelSpec(source="embedded", precision="int4", backend="torchao", torchao_group_size=128)
    if capability >= (8, 0):
        config = config_for(spec, cuda, "target")
        assert type(config).__name__ == "Int4WeightOnlyConfig" and config.group_size == 128
        assert config.int4_packing_format == "tile_packed_to_4d" and compute_dtype(spec, cuda) == torch.bfloat16
        assert choose_backend(ModelSpec(source="embedded", precision="int4"), cuda, "target") == "torchao"
    else:
        with pytest.raises(ConfigError, match="compute capability >= 8.0"):
            config_for(spec, cuda, "target")
        if pytest.importorskip("bitsandbytes"):  # auto falls back to the backend that has a kernel
            assert choose_backend(ModelSpec(source="embedded", precision="int4"), cuda, "target") == "bitsandbytes"


@pytest.mark.system
def test_install_torch_never_reaches_the_network_when_torch_imports(tmp_path):
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this venv's torch
    (venv_bin / "python").chmod(0o755)
    pip = venv_bin / "pip"
    pip.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'pip-calls'}\nexit 1\n")
    pip.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts/install_torch.sh"), str(pip)], capture_output=True,
                          text=True, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert f"torch already importable: {torch.__version__}" in done.stdout
    assert not (tmp_path / "pip-calls").exists()
