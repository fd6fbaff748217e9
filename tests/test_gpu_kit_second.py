"""The GPU kit's second edition, the parts of its logic that decide a verdict: the τ > 1.5 check of the identity stage
fails a draft that does not agree with the target and passes one that does; the cycle target is what the stage says;
the width probe's rounding bound; the xz relay of the GGUF in parts sized for a call."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_kit import accept_identity as ai  # noqa: E402
from gpu_kit import carry  # noqa: E402
from gpu_kit.checks import hf_greedy, ours  # noqa: E402
from gpu_kit.width_probe import bf16_ulp  # noqa: E402


def test_cycle_successor_is_a_permutation_of_cycles():
    succ = ai.cycle_successor(100, 8, seed=3)
    assert sorted(succ.tolist()) == list(range(100))
    lengths = set()
    for start in range(100):  # every token returns to itself after its cycle's length (8, the last one 4)
        x, n = succ[start].item(), 1
        while x != start:
            x, n = succ[x].item(), n + 1
        lengths.add(n)
    assert lengths == {8, 4}


def test_tau_check_fails_a_disagreeing_draft_and_passes_the_target_itself():
    from gpu_kit import shapes
    from toolkit.speculative.drafters import DraftModel

    torch.manual_seed(0)
    base = shapes.build("tiny", torch.device("cpu"), torch.float32)
    succ = ai.cycle_successor(base.config.vocab_size)
    prompt = ai.cycle_prompts(succ, 1, 12)[0]
    target = ai._cycle_copy(base, succ, 0.0)  # layers off: the greedy output follows the cycle exactly
    assert ai.deviation(target, succ, prompt, 8) == 0.0
    stranger = shapes.build("tiny", torch.device("cpu"), torch.float32, seed=7)  # random: proposes other tokens
    want = hf_greedy(target, prompt, 8)
    rows = []
    for name, draft in (("itself", target), ("stranger", stranger)):
        got, stats = ours(target, DraftModel(draft), prompt, 8)
        rows.append(ai._row(name, got, want, stats, name))
    assert [r["ok"] for r in rows] == [True, True]  # lossless either way ...
    failed = ai.failures(rows)
    assert len(failed) == 1 and failed[0].startswith("stranger: tau 1.0 <= 1.5")  # ... but only one is accepted
    assert rows[0]["tau"] > 1.5
    assert ai.failures([{"path": "p", "ok": False, "first_divergence": 3, "tau": 4.0}]) == [
        "p: differs from HF greedy at token 3"]


def test_bf16_ulp():
    assert bf16_ulp(1.0) == 2 ** -7 and bf16_ulp(-3.0) == 2 ** -6 and bf16_ulp(20.0) == 2 ** -3
    assert bf16_ulp(0.0) == 0.0


def test_xz_parts_sized_for_a_call_restore_the_file(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(50_000) + b"\0" * 150_000)  # compresses to ~50 kB
    parts = carry.split_file(src, tmp_path / "parts", 1, first_bytes=10_000, max_bytes=30_000, compress=True)
    sizes = [p.stat().st_size for p in parts]
    assert sizes[0] == 10_000 and all(s <= 30_000 for s in sizes[1:]) and len(parts) == 3
    joined = carry.join_parts(tmp_path / "parts", tmp_path / "joined")
    assert joined.read_bytes() == src.read_bytes()


def test_identity_verdict_of_a_cut_stage_is_not_a_miss():
    from gpu_kit.targets import _identity

    rows = [{"path": "lookup, K=4", "ok": True, "tau": 2.333}, {"path": "draft model", "ok": True, "tau": 4.8}]
    cut = {"accept_identity": {"status": "running", "result": {"rows": rows}}}
    text, verdict = _identity(cut)
    assert verdict == "not measured: cut" and "2 of 2 rows" in text and "cut (running)" in text
    done = {"accept_identity": {"status": "ok", "result": {"rows": rows, "failures": []}}}
    assert _identity(done)[1] == "met"
    failed = {"accept_identity": {"status": "failed", "result": {"rows": rows, "failures": ["draft model: tau 1.2"]}}}
    assert _identity(failed)[1] == "missed: draft model: tau 1.2"
    capped = {"accept_identity": {"status": "ok", "result": {"rows": rows, "failures": [], "cut": "before 'x'"}}}
    assert _identity(capped)[1] == "not measured: cut" and "(before 'x')" in _identity(capped)[0]


def test_long_context_verdict_reads_the_decode_rate_of_rows_within_a_quarter_of_the_bytes():
    """The H100's 32k run of 2026-11-27 (4th) timed prefill and decode together (the prefill most of it), so the
    verdict reads the decode's tok/s, with the end-to-end ratio beside it; a row over 25% of the bytes is not one."""
    from gpu_kit.kv_long import decode_rate
    from gpu_kit.targets import _long

    assert decode_rate(8 * 63, 2900.0, 2500.0) == {"prefill_s": 2.5, "decode_tok_s": 8 * 63 / 0.4}
    assert decode_rate(0, 10.0, 5.0)["decode_tok_s"] is None and decode_rate(8, 5.0, 5.0)["decode_tok_s"] is None
    rows = {"none": {"tok_s": 177.8, "decode_tok_s": 1000.0, "kv_bytes": 8000},
            "KIVI-4": {"tok_s": 150.0, "decode_tok_s": 3000.0, "kv_bytes": 2800},  # 35% of the bytes
            "L2-norm": {"tok_s": 180.9, "decode_tok_s": 1600.0, "kv_bytes": 1900}}
    results = {"kv_long": {"status": "ok", "result": {"runs": {"llama-3.2-1b, 32768 tokens, B = 8": {"rows": rows}}}}}
    text, verdict = _long(results)
    assert verdict == "met" and text.startswith("L2-norm: 1.60x the uncompressed's decode tok/s")
    assert "(prefill included: 1.02x)" in text and "24% of its KV bytes" in text
    for row in rows.values():  # a report before the decode rate was recorded: end to end
        row.pop("decode_tok_s")
    assert _long(results)[1] == "missed by 0.48x"


def test_linear_probe_counts_every_linear_once_with_its_bytes():
    from conftest import tiny_llama
    from gpu_kit.linear_probe import linear_probe
    from gpu_kit.targets import _linears

    model = tiny_llama(layers=3)
    probe = linear_probe(model, calls=2, replays=2)
    names = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "lm_head"}
    assert set(probe["layers"]) == names
    assert all(layer["count"] == (1 if name == "lm_head" else 3) for name, layer in probe["layers"].items())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert probe["bytes_per_token"] == sum(m.weight.numel() * 4 for m in linears)
    assert probe["layers"]["mlp.down_proj"]["in"] == 128 and probe["ms_per_token"] > 0
    step_ms = 2 * probe["ms_per_token"]
    assert _linears({"linear_probe": probe}, {"tok_s": 1000.0 / step_ms}) == \
        f"linears {probe['ms_per_token']:.2f} of {step_ms:.2f} ms/token"


def test_compositions_verdict_judges_every_pair_but_the_reference_by_its_worst():
    from gpu_kit.compositions import kv_recipes, verdict

    labels = list(kv_recipes(8))
    assert [label.split(" ")[0] for label in labels] == ["StreamingLLM", "none", "KIVI-4", "L2-norm", "head-aware"]
    assert verdict({"rows": {}}) == ("no composition ran in both forms", "not measured")
    rows = {"none": {"x_eager": 0.9}, "StreamingLLM (4 sinks + 508)": {"x_eager": 1.6},
            "EAGLE-1 head, K=3 chain": {"x_eager": 1.25}, "KIVI-4": {"eager": {"tok_s": 3.0}}}  # KIVI-4: cut
    text, judged = verdict({"rows": rows})
    assert judged == "missed (EAGLE-1 head, K=3 chain: 1.25x of 1.3x)" and "none" not in text
    rows["EAGLE-1 head, K=3 chain"]["x_eager"] = 1.31
    assert verdict({"rows": rows})[1] == "met"
