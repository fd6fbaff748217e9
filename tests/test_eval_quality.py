"""Output quality in the evaluator and the search: the ``quality`` section (ROUGE-L on summarization prompts, exact
match / first divergence on code prompts, against the fp32 AR reference text, through the shipped ``evaluate``
modules) in ``metrics.json`` and ``report.md`` and its schema, and a search bounded by ``min_rouge_l``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama

from eval.scenarios import Scenario, check_bound, constraints
from toolkit.errors import ConfigError
from toolkit.measure.harness import Prompt

# evaluate reads its cache locations once, when it is first imported (lazily, by toolkit.metrics.load, at test time):
# keep this session's copies out of the user's cache
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="toolkit-hf-modules-"))
os.environ.setdefault("HF_METRICS_CACHE", tempfile.mkdtemp(prefix="toolkit-hf-metrics-"))

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------- the evaluator's section
class _Words:
    """A tokenizer stub: id i is the word VOCAB[i]."""

    VOCAB = ("<s>", "the", "cat", "sat", "on", "mat", "lay", "dog")

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))


def test_quality_section_scores_summaries_by_rouge_l_and_code_by_first_divergence():
    from eval.quality import quality_section

    items = [SimpleNamespace(id="chat", kind="chat", input_ids=torch.tensor([[1]])),
             SimpleNamespace(id="sum", kind="summarize", input_ids=torch.tensor([[2]]), reference="a dog sat on a mat"),
             SimpleNamespace(id="code", kind="code", input_ids=torch.tensor([[3]]))]
    ours = [[7, 7], [1, 2, 6, 4, 1, 5], [4, 5, 3, 2]]
    fp32 = [[7, 7], [1, 2, 3, 4, 1, 5], [4, 5, 1, 2]]
    generator = SimpleNamespace(tokenizer=_Words(), target=object())
    first = {"ours": [(ids, None) for ids in ours], "ar_fp32": [(ids, None) for ids in fp32]}
    q = quality_section(items, first, generator, object(), SimpleNamespace(do_sample=False))
    assert q["reference"]["method"] == "ar_fp32" and q["greedy"] and "reason" not in q
    assert [p["id"] for p in q["rouge_l"]["prompts"]] == ["sum"]  # only the summarization prompt
    assert q["rouge_l"]["value"] == pytest.approx(5 / 6)  # "the cat lay on the mat" vs "the cat sat on the mat"
    assert q["code"]["prompts"] == [{"id": "code", "exact_match": False, "first_divergence": 2,
                                     "matched_fraction": 0.5, "reference_tokens": 4}]
    assert q["code"]["exact_match"] == 0.0
    # the recipe's own target is the fp32 reference: its `ar` run is the reference text
    same = quality_section(items[1:2], {"ours": first["ours"][1:2], "ar": first["ar_fp32"][1:2]},
                           generator, generator.target, SimpleNamespace(do_sample=False))
    assert same["reference"]["method"] == "ar" and same["code"] is None and "code" in same["reason"]
    none = quality_section(items[:1], {"ours": first["ours"][:1]}, generator, None, SimpleNamespace(do_sample=False))
    assert none["rouge_l"] is None and none["code"] is None and none["reference"] is None
    assert none["rouge_l_written"] is None and q["rouge_l_written"]["prompts"][0]["id"] == "sum"
    # a written answer needs no reference model: "the cat lay on the mat" vs "a dog sat on a mat" share "on", "mat"
    written = quality_section(items[1:2], {"ours": first["ours"][1:2]}, generator, None,
                              SimpleNamespace(do_sample=False))
    assert written["reference"] is None and written["rouge_l_written"]["value"] == pytest.approx(2 / 6)
    assert q["rouge_l_written"] == written["rouge_l_written"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    from eval.evaluate import EvalSettings, evaluate
    from toolkit.recipe import Recipe

    target = tiny_llama()
    g = torch.Generator().manual_seed(3)
    prompts = [Prompt("sum-0", "summarize", torch.randint(3, 128, (1, 12), generator=g), reference="written words"),
               Prompt("code-0", "code", torch.randint(3, 128, (1, 10), generator=g))]
    ppl_ids = torch.randint(3, 128, (64,), generator=g).tolist()
    settings = EvalSettings.fast(max_new_tokens=16, repeats=1, warmup=0, ppl_tokens=64, ppl_window=32, ppl_stride=16,
                                 baselines=["ar"])
    stream = {"policy": "streaming", "sink_tokens": 2, "window": 6}
    out = {}
    for name, kv, baselines in (("none", {"policy": "none"}, ["ar"]), ("stream", stream, ["ar"]),
                                ("untimed", {"policy": "none"}, False)):  # no AR timed: the reference is generated
        recipe = Recipe.from_dict({"name": f"tiny-{name}", "target": {"device": "cpu"}, "kv": kv,
                                   "spec": {"drafter": "ngram", "num_draft_tokens": 3},
                                   "generation": {"max_new_tokens": 16}})
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, evaluate(recipe, settings=dataclasses.replace(settings, baselines=baselines),
                                      out_dir=folder, target=target, tokenizer=None, prompts=prompts, ppl_ids=ppl_ids,
                                      progress=False))
    return out


def test_report_carries_quality_beside_perplexity_and_the_schema_checks_it(evaluated):
    from eval.evaluate import validate_metrics

    folder, result = evaluated["none"]
    m = json.loads((folder / "metrics.json").read_text())
    validate_metrics(m)
    q = m["quality"]
    # fp32 greedy without compression is lossless: the same text as the fp32 AR reference
    assert q["reference"]["method"] == "ar" and q["rouge_l"]["value"] == 1.0 and q["code"]["exact_match"] == 1.0
    assert q["code"]["prompts"][0]["first_divergence"] is None and q["code"]["prompts"][0]["reference_tokens"] == 16
    assert result.rouge_l == 1.0 and result.code_exact_match == 1.0 and "ROUGE-L 1.000" in result.summary_line()
    report = (folder / "report.md").read_text()
    assert report.index("## Perplexity") < report.index("## Output quality vs the fp32 AR reference") < \
        report.index("## Speed")
    assert "| sum-0 | ROUGE-L F1 (precision / recall) | 1.000 (1.000 / 1.000) |" in report
    # the prompt's written answer shares no word with token ids read as words
    assert q["rouge_l_written"]["value"] == 0.0 == result.rouge_l_written
    assert "### Against the suite's written answers" in report and "| sum-0 | 0.000 (0.000 / 0.000) |" in report
    stream = evaluated["stream"][1].to_dict()["quality"]
    assert 0.0 <= stream["rouge_l"]["value"] <= 1.0 and stream["code"]["prompts"][0]["first_divergence"] is not None
    untimed = evaluated["untimed"][1].to_dict()
    assert set(untimed["methods"]) == {"ours"} and untimed["quality"]["reference"]["method"] == "generated"
    assert untimed["quality"]["rouge_l"]["value"] == 1.0 and untimed["quality"]["code"]["exact_match"] == 1.0
    for path, value, where in ((("rouge_l", "value"), 1.5, "quality/rouge_l/value"),
                               (("code", "prompts"), [], "quality/code/prompts"),
                               (("reference", "method"), "hub", "quality/reference")):
        broken = json.loads(json.dumps(m))
        broken["quality"][path[0]][path[1]] = value
        with pytest.raises(ValueError, match=where):
            validate_metrics(broken)
    del m["quality"]
    with pytest.raises(ValueError, match="quality"):
        validate_metrics(m)


# ------------------------------------------------------------------------------------- a search bounded by ROUGE-L
def _space(min_rouge_l) -> dict:
    return {"scenario": "short", "trials": 2,
            "constraints": {"ppl_ratio_max": None, "min_rouge_l": min_rouge_l},
            "base": {"target": {"device": "cpu"}, "kv": {"policy": "none"},
                     "spec": {"drafter": "ngram", "num_draft_tokens": 3}, "generation": {"max_new_tokens": 24}},
            "eval": {"num_prompts": 1, "max_new_tokens": 24, "repeats": 1, "warmup": 0, "ppl_tokens": 64,
                     "ppl_window": 32, "ppl_stride": 16, "baselines": ["ar"]},
            "space": {"kv": {"choices": {"none": {"kv": {"policy": "none"}},
                                         "stream": {"kv": {"policy": "streaming", "sink_tokens": 2, "window": 6}}}}}}


def _never_load(recipe):
    raise AssertionError("a refused search must not load a model")


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "high", True])
def test_a_rouge_l_bound_outside_zero_one_is_refused_naming_field_and_range(tmp_path, bad):
    from eval.search import run_search
    from eval.space_file import load_space

    with pytest.raises(ConfigError, match=r"^search\.constraints\.min_rouge_l: must be a ROUGE-L F1 score in \[0, 1\]"):
        load_space(_space(bad))
    with pytest.raises(ConfigError, match=r"^--min-rouge-l: must be a ROUGE-L F1 score in \[0, 1\]"):
        run_search("short", space=_space(None), min_rouge_l=bad, out=tmp_path, models_fn=_never_load,
                   prompts=[[5, 6, 7]], progress=False)
    with pytest.raises(ConfigError, match=r"min_rouge_l.*\[0, 1\]"):
        Scenario("short", primary="throughput", min_rouge_l=bad)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_rouge_l_bound_needs_a_summarization_prompt(tmp_path):
    from eval.search import run_search

    with pytest.raises(ConfigError, match=r"search\.constraints\.min_rouge_l: ROUGE-L is measured on summarization "
                                          r"prompts.*has only kinds \['ids'\]"):
        run_search("short", space=_space(0.5), out=tmp_path, models_fn=_never_load, prompts=[[5, 6, 7]],
                   progress=False)
    space = {**_space(0.5), "base": {**_space(0.5)["base"], "prompts": "long"}}  # chat + code only
    with pytest.raises(ConfigError, match=r"prompt suite 'long' has only kinds \['chat', 'code'\]"):
        run_search("short", space=space, out=tmp_path, models_fn=_never_load, progress=False)
    for fine in (0.0, 1, None):  # the ends of the range, and no bound
        check_bound("min_rouge_l", fine, "search.constraints.min_rouge_l")


def test_rouge_l_constraint_values():
    sc = Scenario("short", primary="throughput", ppl_ratio_max=None, min_rouge_l=0.8)
    assert constraints(SimpleNamespace(rouge_l=0.9), sc) == {"rouge_l": pytest.approx(-0.1)}  # met
    assert constraints(SimpleNamespace(rouge_l=0.5), sc) == {"rouge_l": pytest.approx(0.3)}  # missed by 0.3
    assert constraints(SimpleNamespace(rouge_l=None), sc) == {"rouge_l": math.inf}  # not measured: infeasible
    assert sc.to_dict()["min_rouge_l"] == 0.8
    # unset, it is left out of study configurations and trial keys: studies from before it existed still resume
    assert "min_rouge_l" not in Scenario("short", primary="throughput").to_dict()


def test_a_time_budget_never_cuts_away_the_summarization_prompt():
    from eval.budget import Workload, fit
    from eval.evaluate import EvalSettings
    from eval.quality import keep_count

    kinds = [SimpleNamespace(kind=k) for k in ("chat", "chat", "summarize", "code")]
    assert keep_count(kinds, 1, ["summarize"]) == 2 and keep_count(kinds, 3, ["summarize"]) == 3
    assert keep_count(kinds, 1, None) == 1 and keep_count(kinds[:2], 1, ["summarize"]) == 1  # none to keep
    settings = EvalSettings.fast(keep_kinds=["summarize"])
    assert settings.to_dict()["keep_kinds"] == ["summarize"] and "keep_kinds" not in EvalSettings.fast().to_dict()
    work = Workload(prompt_lens=[40, 60, 80], methods=3, chunk=5)
    assert fit(settings, work, lambda n: 20.0 + n, budget_s=0.001).settings.num_prompts == 1
    assert fit(settings, work, lambda n: 20.0 + n, budget_s=0.001, min_prompts=2).settings.num_prompts == 2
    with pytest.raises(ConfigError, match="keep_kinds"):
        EvalSettings(keep_kinds="summarize")


@pytest.mark.slow
def test_search_bounded_by_rouge_l_never_chooses_a_trial_below_it(tmp_path):
    import eval.search as S

    target = tiny_llama()
    g = torch.Generator().manual_seed(11)
    prompts = [Prompt("sum-0", "summarize", torch.randint(3, 128, (1, 12), generator=g))]
    result = S.run_search("short", space=_space(0.99), out=tmp_path / "found", progress=False, heldout=False,
                          models_fn=lambda recipe: {"target": target, "tokenizer": None, "draft_model": None,
                                                    "reference_model": None},
                          prompts=prompts, ppl_ids=torch.randint(3, 128, (64,), generator=g).tolist())
    rows = json.loads((tmp_path / "found" / "short" / "trials.json").read_text())["rows"]
    by_kv = {r["params"]["kv"]: r for r in rows}
    assert set(by_kv) == {"none", "stream"}
    for row in rows:  # the constraint is the bound minus the trial's ROUGE-L; feasible iff it is met
        assert row["constraints"] == {"rouge_l": pytest.approx(0.99 - row["summary"]["rouge_l"])}
        assert row["feasible"] == (row["summary"]["rouge_l"] >= 0.99)
    assert by_kv["none"]["summary"]["rouge_l"] == 1.0  # lossless: the fp32 AR text
    assert by_kv["stream"]["summary"]["rouge_l"] < 0.99 and not by_kv["stream"]["feasible"]
    assert result["best"]["params"]["kv"] == "none"
    trial = json.loads(next((tmp_path / "found" / "short" / "trials").glob("*/metrics.json")).read_text())
    assert trial["settings"]["keep_kinds"] == ["summarize"]
    assert trial["quality"]["rouge_l"]["prompts"][0]["id"] == "sum-0"
    assert "ROUGE-L vs fp32 AR" in (tmp_path / "found" / "short" / "pareto.md").read_text()


@pytest.mark.slow
@pytest.mark.heavy  # ~12 s on the embedded model; the tiny-model report tests prove the scoring
def test_embedded_model_texts_are_decoded_and_scored(embedded, tmp_path):
    from eval.evaluate import EvalSettings, evaluate
    from toolkit.measure.prompts import load_suite
    from toolkit.recipe import Recipe

    model, tokenizer = embedded
    suite = {p.kind: p for p in load_suite("short")}  # real prompts: a licence passage to summarize, stdlib code
    settings = EvalSettings.fast(max_new_tokens=16, repeats=1, warmup=0, ppl_tokens=64, ppl_window=64, ppl_stride=32,
                                 baselines=["ar"])
    # lossless recipes score 1.0 (tiny-model tests); here a 32-token cache under prompts of ~100+ tokens, whose
    # real text departs from the fp32 AR text
    recipe = Recipe.from_dict({"name": "embedded-stream", "target": {"source": "embedded", "device": "cpu"},
                               "kv": {"policy": "streaming", "sink_tokens": 4, "window": 28},
                               "spec": {"drafter": "ngram", "num_draft_tokens": 3},
                               "generation": {"max_new_tokens": 16}})
    result = evaluate(recipe, settings=settings, out_dir=tmp_path, target=model, tokenizer=tokenizer,
                      prompts=[suite["summarize"], suite["code"]], progress=False)
    compressed = result.to_dict()["quality"]
    assert compressed["rouge_l"]["tokenization"].startswith("decoded text")
    assert compressed["code"]["prompts"][0]["first_divergence"] is not None
    assert 0.0 <= compressed["rouge_l"]["value"] < 1.0


@pytest.mark.parametrize("suite", ["long-context", "long-context-heldout"])
def test_long_context_suites_carry_written_references(suite):
    """Every long-document prompt has a written answer (what bench/long_context.py scores ROUGE-L against), about
    its own document: the shipped metric scores it higher against its own document than against the others'."""
    from toolkit.measure.prompts import load_suite
    from toolkit.metrics import load

    prompts = load_suite(suite)
    assert all(p.reference and len(p.reference.split()) >= 100 for p in prompts)
    rouge = load("rouge_l")
    documents = [p.prompt[0]["content"] for p in prompts]
    for i, prompt in enumerate(prompts):
        # precision: the share of the answer's words found, in order, in the document
        grounded = rouge.compute(predictions=[prompt.reference] * len(documents), references=documents,
                                 use_aggregator=False)["rouge_l_precision"]
        assert max(range(len(documents)), key=grounded.__getitem__) == i, (prompt.id, grounded)
