"""The HF ``evaluate`` metric modules shipped in the package (``toolkit/metrics``): ROUGE-L and exact match / first
divergence against hand-computed values, the toolkit's own α / τ / KV-bytes / PPL modules aggregating exactly,
``evaluate.combine``, loading by path offline (network refused) and by two processes at once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

import toolkit.metrics as TM
from toolkit.errors import ConfigError

# evaluate reads its cache locations once, when it is first imported (lazily, by toolkit.metrics.load, at test time):
# keep this session's copies out of the user's cache
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="toolkit-hf-modules-"))
os.environ.setdefault("HF_METRICS_CACHE", tempfile.mkdtemp(prefix="toolkit-hf-metrics-"))

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rouge():
    return TM.load("rouge_l")


# ------------------------------------------------------------------------------------------------ ROUGE-L
def test_rouge_l_matches_hand_computed_lcs(rouge):
    ref = "the cat sat on the mat"  # 6 words
    same = rouge.compute(predictions=[ref], references=[ref])
    assert same == {"rouge_l": 1.0, "rouge_l_precision": 1.0, "rouge_l_recall": 1.0}
    # LCS "the cat on the mat" = 5 of 6 words on both sides
    one_off = rouge.compute(predictions=["the cat lay on the mat"], references=[ref])
    assert one_off["rouge_l"] == pytest.approx(5 / 6) and one_off["rouge_l_precision"] == pytest.approx(5 / 6)
    # a prefix: LCS 2, precision 2/2, recall 2/6, F1 = 2 * 1 * (1/3) / (4/3) = 0.5
    prefix = rouge.compute(predictions=["the cat"], references=[ref])
    assert (prefix["rouge_l_precision"], prefix["rouge_l_recall"]) == (1.0, pytest.approx(1 / 3))
    assert prefix["rouge_l"] == pytest.approx(0.5)
    # a subsequence, not a substring: "a c e" in "a b c d e" -> LCS 3; P = 3/3, R = 3/5, F1 = 0.75
    gaps = rouge.compute(predictions=["a c e"], references=["a b c d e"])
    assert gaps["rouge_l"] == pytest.approx(0.75)
    # rouge_score words: case and punctuation are separators, not content
    assert rouge.compute(predictions=["The cat, sat!"], references=["the cat sat"])["rouge_l"] == 1.0
    assert rouge.compute(predictions=["x y"], references=["p q"])["rouge_l"] == 0.0
    each = rouge.compute(predictions=[ref, "the cat"], references=[ref, ref], use_aggregator=False)
    assert each["rouge_l"] == [1.0, pytest.approx(0.5)]
    mean = rouge.compute(predictions=[ref, "the cat"], references=[ref, ref])
    assert mean["rouge_l"] == pytest.approx(0.75) and mean["rouge_l_recall"] == pytest.approx((1 + 1 / 3) / 2)


def test_modules_load_by_path_with_evaluate_itself():
    import evaluate

    for name in TM.NAMES:
        folder = TM.path(name)
        assert folder.is_absolute() and (folder / f"{name}.py").is_file()
        assert folder.parent == ROOT / "toolkit" / "metrics"
    module = evaluate.load(str(TM.path("first_divergence")), keep_in_memory=True)
    assert module.name == "first_divergence" and "Leviathan" in module.citation and module.description
    assert set(module.features) == {"predictions", "references"}
    with pytest.raises(ConfigError, match="metric: unknown metric module 'rouge'.*allowed: rouge_l"):
        TM.path("rouge")


# ------------------------------------------------------------------------------------------ first divergence
def test_exact_match_and_first_divergence_on_known_sequences():
    fd = TM.load("first_divergence")
    preds = [[5, 6, 7, 9], [1, 2, 3], [1, 2], [1, 2, 3], [9, 1], [4]]
    refs = [[5, 6, 7, 8], [1, 2, 3], [1, 2, 3, 4], [1, 2], [1, 2], []]
    each = fd.compute(predictions=preds, references=refs, use_aggregator=False)
    # differs at 3 of 4; identical; a proper prefix (diverges where it ends); longer than the reference; at once;
    # anything against an empty reference
    assert each["first_divergence"] == [3, None, 2, 2, 0, 0]
    assert each["exact_match"] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert each["matched_fraction"] == [0.75, 1.0, 0.5, 1.0, 0.0, 0.0]
    mean = fd.compute(predictions=preds, references=refs)
    assert mean["exact_match"] == pytest.approx(1 / 6)
    assert mean["matched_fraction"] == pytest.approx((0.75 + 1.0 + 0.5 + 1.0) / 6)
    assert mean["first_divergence"] == [3, None, 2, 2, 0, 0]
    with pytest.raises(ValueError):
        fd.compute(predictions=[[1]], references=[[1], [2]])


# --------------------------------------------------------------------------------- the toolkit's own metrics
def test_alpha_tau_kv_and_ppl_modules_aggregate_exactly():
    from toolkit.speculative.stats import GenerationStats, acceptance_summary

    stats = [GenerationStats(rounds=5, drafted=20, accepted=7, committed=12),
             GenerationStats(rounds=3, drafted=12, accepted=12, committed=15),
             GenerationStats(rounds=1, drafted=4, accepted=0, committed=1)]
    summary = acceptance_summary(stats)
    alpha = TM.load("acceptance_rate").compute(accepted=[s.accepted for s in stats], drafted=[s.drafted for s in stats])
    assert alpha == {"acceptance_rate": 19 / 36, "accepted": 19, "drafted": 36}
    assert alpha["acceptance_rate"] == summary["acceptance_rate"]
    tau = TM.load("tokens_per_round").compute(committed=[s.committed for s in stats], rounds=[s.rounds for s in stats])
    assert tau == {"tokens_per_round": 28 / 9, "committed": 28, "rounds": 9}
    assert tau["tokens_per_round"] == summary["tokens_per_round"]
    assert TM.load("acceptance_rate").compute(accepted=[0], drafted=[0])["acceptance_rate"] == 0.0
    with pytest.raises(ValueError, match="accepted <= drafted"):
        TM.load("acceptance_rate").compute(accepted=[5], drafted=[4])
    kv = TM.load("kv_bytes").compute(kv_bytes=[1000, 3000, 2000], uncompressed_kv_bytes=[4000, 4000, 4000])
    assert kv == {"kv_bytes_peak": 3000, "kv_bytes_mean": 2000.0, "uncompressed_kv_bytes_peak": 4000,
                  "kv_compression_ratio": 0.5}
    ppl = TM.load("cache_perplexity")
    assert ppl.compute(nll_sum=[2.0, 4.0], tokens=[2, 4]) == {"perplexity": math.exp(1.0), "nll_mean": 1.0, "tokens": 6}
    with pytest.raises(ValueError, match="no predicted tokens"):
        ppl.compute(nll_sum=[0.0], tokens=[0])


def test_cache_perplexity_module_reproduces_the_evaluators_ppl_under_a_compressed_cache():
    from eval.metrics import perplexity_through_cache
    from toolkit.kv import make_policy
    from toolkit.recipe import KVSpec

    model = tiny_llama()
    ids = torch.randint(3, 128, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    policy = make_policy(KVSpec("streaming", {"sink_tokens": 4, "window": 16}))
    runs = [perplexity_through_cache(model, part, policy, chunk=4) for part in (ids[:40], ids[40:])]
    out = TM.load("cache_perplexity").compute(nll_sum=[r["nll_sum"] for r in runs], tokens=[r["tokens"] for r in runs])
    assert out["tokens"] == sum(r["tokens"] for r in runs) == 78
    assert out["perplexity"] == pytest.approx(math.exp(sum(r["nll_sum"] for r in runs) / 78), rel=1e-12)
    single = TM.load("cache_perplexity").compute(nll_sum=[runs[0]["nll_sum"]], tokens=[runs[0]["tokens"]])
    assert single["perplexity"] == pytest.approx(runs[0]["value"], rel=1e-12)


def test_evaluate_combine_merges_the_toolkit_modules():
    import evaluate

    inputs = {"accepted": [3, 1], "drafted": [4, 4], "committed": [5, 3], "rounds": [2, 2],
              "kv_bytes": [100, 300], "uncompressed_kv_bytes": [400, 400], "nll_sum": [2.0, 4.0], "tokens": [2, 4]}
    names = ["acceptance_rate", "tokens_per_round", "kv_bytes", "cache_perplexity"]
    merged = TM.combine(names).compute(**inputs)
    assert merged == {"acceptance_rate": 0.5, "accepted": 4, "drafted": 8, "tokens_per_round": 2.0, "committed": 8,
                      "rounds": 4, "kv_bytes_peak": 300, "kv_bytes_mean": 200.0, "uncompressed_kv_bytes_peak": 400,
                      "kv_compression_ratio": 0.5, "perplexity": math.exp(1.0), "nll_mean": 1.0, "tokens": 6}
    by_path = evaluate.combine([evaluate.load(str(TM.path(n)), keep_in_memory=True) for n in names[:2]],
                               force_prefix=True)
    assert by_path.compute(**inputs) == {"acceptance_rate_acceptance_rate": 0.5, "acceptance_rate_accepted": 4,
                                         "acceptance_rate_drafted": 8, "tokens_per_round_tokens_per_round": 2.0,
                                         "tokens_per_round_committed": 8, "tokens_per_round_rounds": 4}


def test_a_cached_copy_cut_short_is_replaced():
    from evaluate import config
    from evaluate.loading import files_to_hash

    script = TM.path("kv_bytes") / "kv_bytes.py"
    TM.load("kv_bytes")
    copy = (Path(config.HF_MODULES_CACHE) / "evaluate_modules" / "metrics" / "kv_bytes" / files_to_hash([str(script)])
            / "kv_bytes.py")
    assert copy.read_bytes() == script.read_bytes()
    copy.write_text("import datasets\nclass Kv")  # a copy a killed process left half-written
    TM.load("kv_bytes")
    assert copy.read_bytes() == script.read_bytes()


# ------------------------------------------------------------------------------ offline and concurrent loading
_LOAD_ALL = """
import json, os, socket, sys, time
attempts = []
def refuse(*args, **kwargs):  # any connection or name lookup is recorded (a caller may swallow the error)
    attempts.append(repr(args)[:200])
    raise OSError("network access attempted")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
import evaluate
import toolkit.metrics as TM
go = sys.argv[1] if len(sys.argv) > 1 else None
if go:  # wait until every process has imported evaluate, then load at the same time
    open(go + "." + str(os.getpid()), "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
out = {n: TM.load(n).name for n in TM.NAMES}
out["by_path"] = evaluate.load(str(TM.path("rouge_l")), keep_in_memory=True).compute(
    predictions=["the cat lay on the mat"], references=["the cat sat on the mat"])["rouge_l"]
out["attempts"] = attempts
out["combined"] = TM.combine(["acceptance_rate", "tokens_per_round"]).compute(
    accepted=[3], drafted=[4], committed=[4], rounds=[1])
print(json.dumps(out))
"""


def _env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    return {**env, "HF_MODULES_CACHE": str(cache / "modules"), "HF_METRICS_CACHE": str(cache / "metrics"),
            "HF_HOME": str(cache / "home"), "PYTHONPATH": str(ROOT), **extra}


def _check(stdout: str) -> None:
    out = json.loads(stdout.strip().splitlines()[-1])
    assert {n: out[n] for n in TM.NAMES} == {n: n for n in TM.NAMES}
    assert out["by_path"] == pytest.approx(5 / 6) and out["attempts"] == []
    assert out["combined"] == {"acceptance_rate": 0.75, "accepted": 3, "drafted": 4, "tokens_per_round": 4.0,
                               "committed": 4, "rounds": 1}


@pytest.mark.slow
@pytest.mark.system
def test_two_processes_load_at_once_into_one_fresh_cache_with_the_network_refused(tmp_path):
    """Two processes load every module at once, with every connection and name lookup refused (and recorded):
    nothing goes to the network, even without HF's offline flags, and a cut-short copy left by a killed process is
    replaced."""
    from evaluate.loading import files_to_hash

    script = TM.path("rouge_l") / "rouge_l.py"  # and a copy a killed process left cut short, for both to find
    folder = tmp_path / "modules" / "evaluate_modules" / "metrics" / "rouge_l"
    stale = folder / files_to_hash([str(script)]) / "rouge_l.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("import datasets\nclass Rou")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_ALL, str(go)], env=_env(tmp_path), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("go.*"))) < 2 and time.monotonic() < deadline and all(p.poll() is None
                                                                                       for p in procs):
            time.sleep(0.05)
        go.touch()
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
        _check(stdout)
    assert stale.read_bytes() == script.read_bytes()
    copies = sorted({p.name for p in (tmp_path / "modules").rglob("*.py") if p.name != "__init__.py"})
    assert copies == sorted(f"{n}.py" for n in TM.NAMES)  # evaluate's importable copies, in HF_MODULES_CACHE
