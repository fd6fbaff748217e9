"""The evaluator end to end on tiny random models: files, schema, memory fields, KV policy effect, result caching."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from eval.evaluate import EvalSettings, evaluate, results_dir, validate_metrics
from toolkit.recipe import KVSpec, Recipe

SETTINGS = EvalSettings.fast(max_new_tokens=24, repeats=2, warmup=1, ppl_tokens=120, ppl_window=64, ppl_stride=32)
QUICK = EvalSettings.fast(max_new_tokens=16, repeats=1, warmup=0, ppl_tokens=120, ppl_window=64, ppl_stride=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(kv=None, **spec):
    data = {"name": "tiny", "target": {"device": "cpu"}, "draft": {"device": "cpu"},
            "spec": {"drafter": "draft_model", "num_draft_tokens": 3, **spec},
            "generation": {"max_new_tokens": 64}}
    if kv:
        data["kv"] = kv
    return Recipe.from_dict(data)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama()
    return target, perturbed_copy(target, scale=0.3)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (12, 20)]
    return prompts, torch.randint(3, 128, (120,), generator=g).tolist()


def _evaluate(recipe, models, inputs, out, **kw):
    target, draft = models
    prompts, ppl_ids = inputs
    result = evaluate(recipe, settings=kw.pop("settings", SETTINGS), out_dir=out, target=target, tokenizer=None,
                      draft_model=draft, prompts=prompts, ppl_ids=ppl_ids, progress=False, **kw)
    metrics = result.to_dict()  # the metrics.json document; the typed attributes read the same numbers
    assert result.throughput.median == metrics["methods"]["ours"]["throughput"]["median"]
    assert result.ppl == metrics["perplexity"]["configured"]["value"] and result.skipped == metrics["skipped"]
    return metrics


@pytest.fixture(scope="module")
def plain(models, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    return out, _evaluate(_recipe(), models, inputs, out)


def test_report_files_written_and_json_validates(plain):
    import jsonschema

    out, metrics = plain
    for name in ("config.yaml", "metrics.json", "report.md", "throughput_vs_length.png", "kv_bytes_vs_length.png",
                 "acceptance_by_position.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    on_disk = json.loads((out / "metrics.json").read_text())
    from eval.document import SCHEMA_PATH

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.validate(on_disk, schema)
    assert Recipe.load(out / "config.yaml").config_hash() == _recipe().config_hash()
    report = (out / "report.md").read_text()
    assert "window 64, stride 32" in report and "chunks of K+1 = 4" in report  # protocol printed with the numbers
    assert not list(out.glob(".*.tmp"))  # no leftovers of atomic writes


def test_schema_rejects_broken_metrics(plain):
    _, metrics = plain
    broken = json.loads(json.dumps(metrics))
    del broken["memory"]["kv_bytes"]
    with pytest.raises(ValueError, match="kv_bytes"):
        validate_metrics(broken)
    broken = json.loads(json.dumps(metrics))
    broken["acceptance"]["acceptance_rate"] = 1.5
    with pytest.raises(ValueError, match="acceptance_rate"):
        validate_metrics(broken)


def test_memory_fields_present_and_positive(plain):
    _, m = plain
    mem = m["memory"]
    assert mem["weight_bytes"]["target"] > 0 and mem["weight_bytes"]["draft"] > 0
    for key in ("target_final", "target_peak", "draft_final", "draft_peak", "uncompressed_target_peak"):
        assert mem["kv_bytes"][key] > 0, key
    assert mem["peak"]["device"] == "cpu" and mem["peak"]["peak_rss_bytes"] > 0
    assert mem["peak"]["peak_rss_growth_bytes"] >= 0
    # without compression the target runs on the static cache: its exact KV bytes are its buffers, whole
    # CAPACITY_STEP multiples of slots (+ the SPAN_STEP slack of a dynamic span), at least the uncompressed size
    from toolkit.kv.static import CAPACITY_STEP, SPAN_STEP

    per_token, peak = mem["kv_bytes"]["per_token_uncompressed"], mem["kv_bytes"]["target_peak"]
    assert peak >= mem["kv_bytes"]["uncompressed_target_peak"]
    assert peak % per_token == 0 and (peak // per_token - SPAN_STEP) % CAPACITY_STEP == 0
    for name, entry in m["methods"].items():
        assert entry["peak_memory"]["peak_rss_bytes"] > 0, name


def test_acceptance_speed_fidelity_and_baselines(plain):
    _, m = plain
    acc = m["acceptance"]
    assert acc["consistent"] and acc["accepted"] <= acc["drafted"]
    assert acc["committed"] == acc["accepted"] + acc["rounds"]
    assert set(m["methods"]) == {"ours", "ar", "assisted"}
    for entry in m["methods"].values():
        assert entry["throughput"]["median"] > 0 and len(entry["throughput"]["values"]) == 2
        assert entry["new_tokens"] == 48  # 2 prompts x 24 tokens, EOS disabled for every method
    assert m["ratios"]["ours_vs_ar"] > 0 and "assisted_vs_ar" in m["ratios"]
    # greedy, fp32, no compression: lossless against the target's own greedy output
    assert m["fidelity"]["vs_ar"]["identical"] and m["fidelity"]["vs_ar"]["match_rate"] == 1.0
    assert m["perplexity"]["ratio_to_fp32"] == pytest.approx(1.0, rel=1e-4)


def test_kv_bytes_with_policy_smaller(models, inputs, tmp_path):
    from toolkit.kv import POLICIES, make_policy

    make_policy(KVSpec())
    if "streaming" not in POLICIES:
        pytest.skip("toolkit.kv has no 'streaming' policy yet")
    settings = EvalSettings.fast(max_new_tokens=40, repeats=1, warmup=0, ppl_tokens=120, ppl_window=64,
                                 ppl_stride=32, baselines=False)
    full = _evaluate(_recipe(), models, inputs, tmp_path / "none", settings=settings, plots=False)
    streamed = _evaluate(_recipe(kv={"policy": "streaming", "sink_tokens": 4, "window": 16}), models, inputs,
                         tmp_path / "streaming", settings=settings, plots=False)
    assert streamed["memory"]["kv_bytes"]["target_peak"] < full["memory"]["kv_bytes"]["target_peak"]
    assert streamed["memory"]["kv_bytes"]["target_final"] < full["memory"]["kv_bytes"]["target_final"]
    # StreamingLLM (absolute positions, exact window) runs on the static cache's ring: positions leave it by being
    # overwritten, never by a compression
    assert streamed["memory"]["compressions"]["target"] == full["memory"]["compressions"]["target"] == 0
    assert streamed["perplexity"]["configured"]["peak_kv_bytes"] < full["perplexity"]["configured"]["peak_kv_bytes"]


def test_existing_results_skipped_unless_force(plain, models, inputs):
    out, m = plain
    before = (out / "metrics.json").stat().st_mtime_ns
    again = _evaluate(_recipe(), models, inputs, out)
    assert again["skipped"] and (out / "metrics.json").stat().st_mtime_ns == before
    forced = _evaluate(_recipe(), models, inputs, out, force=True, settings=QUICK, plots=False)
    assert not forced["skipped"] and (out / "metrics.json").stat().st_mtime_ns != before


def test_results_dir_naming():
    r = _recipe()
    assert results_dir(r, EvalSettings(), "results").name == f"tiny-{r.config_hash()}"
    fast = results_dir(r, EvalSettings.fast(), "results").name
    assert fast.startswith(f"tiny-{r.config_hash()}-fast-") and fast != results_dir(r, SETTINGS, "results").name


def test_search_mode_reuses_identical_baselines(models, inputs, tmp_path):
    settings = EvalSettings.fast(max_new_tokens=16, repeats=1, warmup=0, ppl_tokens=120, ppl_window=64,
                                 ppl_stride=32, baselines=["ar"], reuse_baselines=True)
    first = _evaluate(_recipe(), models, inputs, tmp_path / "a", settings=settings, plots=False)
    second = _evaluate(_recipe(num_draft_tokens=2), models, inputs, tmp_path / "b", settings=settings, plots=False)
    assert set(first["methods"]) == {"ours", "ar"} and not first["methods"]["ar"].get("reused")
    assert second["methods"]["ar"]["reused"]
    assert second["methods"]["ar"]["throughput"] == first["methods"]["ar"]["throughput"]


def test_every_baseline_a_search_may_name_has_a_reuse_key():
    """The long and memory spaces (and short's) time ``ar_static`` with ``reuse_baselines``: its key was missing, so
    every trial of those searches failed with ``KeyError: 'ar_static'``. Each baseline's key names its models by
    object; a recipe's own drafter settings do not change the key of a baseline that does not read them."""
    from eval.evaluate import _baseline_key
    from eval.runners import BASELINES
    from toolkit.measure.harness import Prompt
    from toolkit.recipe import GenerationSpec

    target, draft, reference = tiny_llama(seed=1), tiny_llama(seed=2), tiny_llama(seed=3)
    items = [Prompt("p", "chat", torch.tensor([[5, 6, 7]]))]
    gen = GenerationSpec(max_new_tokens=8)

    def key(method, recipe=None, model=target):
        return _baseline_key(method, recipe or _recipe(), model, draft, reference, items, gen, SETTINGS)

    keys = {m: key(m) for m in BASELINES}
    assert len(set(keys.values())) == len(BASELINES)
    assert keys["ar_static"][1] == keys["ar"][1] == (id(target),) and keys["ar_fp32"][1] == (id(reference),)
    assert keys["assisted"][1] == (id(target), id(draft))
    for m in ("ar", "ar_static", "ar_fp32", "prompt_lookup_10"):
        assert key(m, _recipe(num_draft_tokens=2)) == keys[m]
    assert key("ar_static", model=reference) != keys["ar_static"]


def test_batched_recipe_is_scored_as_it_runs(models, inputs, tmp_path):
    """batch_size > 1: a batch stage over the suite next to HF batched AR and our single-row decoder; throughput and
    memory are the batched run's; rows identical to each prompt alone; HF batched AR reused across evaluations."""
    from eval.evaluate import clear_model_cache

    clear_model_cache()
    target, _ = models
    prompts, ppl_ids = inputs
    g = torch.Generator().manual_seed(5)
    prompts = prompts + [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 15)]
    recipe = Recipe.from_dict({"name": "tiny-batch", "target": {"device": "cpu"}, "draft": None, "batch_size": 3,
                               "spec": {"drafter": "lookup", "num_draft_tokens": 4, "adaptive": "cost"},
                               "generation": {"max_new_tokens": 64}})
    settings = EvalSettings.fast(max_new_tokens=16, repeats=2, warmup=0, ppl_tokens=120, ppl_window=64,
                                 ppl_stride=32, num_prompts=1, reuse_baselines=True)
    result = evaluate(recipe, settings=settings, out_dir=tmp_path / "a", target=target, tokenizer=None,
                      prompts=prompts, ppl_ids=ppl_ids, progress=False)
    m = result.to_dict()
    batch = m["batch"]
    validate_metrics(m)
    assert batch["batch_size"] == 3 and batch["batched"] and len(batch["prompts"]) == 4  # num_prompts cuts stage 1
    assert len(m["prompts"]) == 1 and set(batch["methods"]) == {"ours-batch", "hf-batch-ar", "ours-single"}
    assert batch["rows_identical_to_single"] == [True] * 4
    assert all(e["new_tokens"] == 4 * 16 for e in batch["methods"].values())
    assert result.throughput.median == batch["methods"]["ours-batch"]["throughput"]["median"]
    assert result.single_throughput.median == m["methods"]["ours"]["throughput"]["median"]
    assert set(result.ratios) >= {"ours_batch_vs_hf_batch_ar", "ours_batch_vs_ours_single"}
    per_token = m["memory"]["kv_bytes"]["per_token_uncompressed"]
    longest_three = sorted(len(p) for p in prompts)[-3:]
    # three rows share the static cache: at least their prompts; at most 3 rows (+ a spare one) x the capacity of
    # the longest row (prompt + new tokens + a verify block of K + 1, rounded up to CAPACITY_STEP) + SPAN_STEP slack
    from toolkit.kv.static import SPAN_STEP, capacity_for

    assert per_token * sum(longest_three) <= batch["kv_peak_bytes"]
    assert batch["kv_peak_bytes"] <= 4 * per_token * (capacity_for(max(longest_three) + 16 + 5) + SPAN_STEP)
    assert m["memory"]["total_peak_bytes"] == m["memory"]["weight_bytes"]["total"] + batch["kv_peak_bytes"]
    assert "### Batch size 3 (batched)" in (tmp_path / "a" / "report.md").read_text()
    again = evaluate(recipe.replace(name="tiny-batch-k2", spec=recipe.spec.__class__(drafter="ngram",
                     num_draft_tokens=2)), settings=settings, out_dir=tmp_path / "b", target=target, tokenizer=None,
                     prompts=prompts, ppl_ids=ppl_ids, progress=False).to_dict()["batch"]
    assert again["methods"]["hf-batch-ar"].get("reused") and not again["methods"]["ours-single"].get("reused")
    assert again["rows_identical_to_single"] == [True] * 4
