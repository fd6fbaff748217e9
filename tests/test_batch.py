"""Batched speculative decoding (toolkit/engine/decoder.py over B rows): every row of a batch gets exactly the output it
gets alone, whatever the batch size, the drafter, the verify width and the rows that leave or join; sampling per row
follows the target's distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import batch_decoder, tiny_llama, tiny_neox
from test_decoder import INIT, hf_greedy, make_prompt

import toolkit
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import LookupDrafter, NGramDrafter, RowDrafters, SuffixDrafter

FLAT = [1.0] * 256                          # drafts are free: every row verifies what it has
# a forward of n tokens costs 1000 n^2 ms: a draft never pays, even one accepted for sure, whatever the round's
# measured bookkeeping costs (a linear price would not do: n accepted tokens then amortize that bookkeeping, and on
# a slow machine a row drafted, CI on stop 66)
STEEP = [1000.0 * n * n for n in range(1, 257)]


def prompts(count: int = 7) -> list[torch.Tensor]:
    out = []
    for seed in range(count):  # repeats inside each prompt, so drafts are accepted and rejected
        base = make_prompt(seed, length=4 + seed)[0]
        out.append(torch.cat([base, base, base[:3]]).view(1, -1))
    return out


@pytest.fixture(scope="module")
def references():
    """{arch: (target, prompts, each prompt's greedy output alone)}."""
    out = {}
    for name, make in (("llama", tiny_llama), ("neox", tiny_neox)):
        target, batch = make(seed=0, **INIT), prompts()
        out[name] = (target, batch, [hf_greedy(target, p, 24) for p in batch])
    return out


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("drafter,curve", [("lookup", FLAT), ("ngram", FLAT), ("suffix", FLAT), ("none", FLAT),
                                           ("lookup", STEEP)], ids=["lookup", "ngram", "suffix", "none", "steep"])
def test_every_row_equals_its_prompt_decoded_alone(references, arch, drafter, curve):
    target, batch, alone = references[arch]
    make_drafter = {"lookup": lambda: LookupDrafter(max_cached_requests=0), "ngram": NGramDrafter,
                    "suffix": lambda: SuffixDrafter(2.0, 0.05, 0), "none": lambda: None}[drafter]
    decoder = batch_decoder(target, make_drafter, VerifyCost(list(curve), learn=False), num_draft_tokens=5,
                            batch_size=3)
    rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=24, ignore_eos=True))
    for (ids, stats), ref in zip(rows, alone):  # 7 prompts through 3 slots: rows leave and join
        assert ids == ref
        assert stats.new_tokens == 24 and stats.committed == stats.accepted + stats.rounds
    accepted = sum(stats.accepted for _, stats in rows)
    assert (accepted > 0) == (drafter != "none" and curve is FLAT)


def test_rows_stop_on_their_own_eos_and_limits():
    target = tiny_llama(seed=0, **INIT)
    batch = prompts(4)
    alone = [hf_greedy(target, p, 20) for p in batch]
    eos = alone[1][5]  # row 1 stops at its 6th token; others wherever that token appears first
    decoder = batch_decoder(target, lambda: LookupDrafter(max_cached_requests=0), VerifyCost(list(FLAT), learn=False),
                            num_draft_tokens=4, batch_size=4)
    rows = decoder.decode_batch(batch, GenerationSpec(max_new_tokens=20), eos_token_ids=[eos])
    for (ids, stats), ref in zip(rows, alone):
        cut = ref.index(eos) + 1 if eos in ref else 20
        assert ids == ref[:cut] and stats.finish_reason == ("eos" if eos in ref else "length")


def test_generator_generate_batch_matches_single_calls_and_falls_back():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target = tiny_llama(seed=0, **INIT)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(128)}, unk_token="t0")))
    texts = [" ".join(f"t{int(i)}" for i in p[0]) for p in prompts(5)]
    recipe = Recipe(name="batch", target=ModelSpec(device="cpu"), draft=None,
                    spec=SpeculationSpec(drafter="lookup", num_draft_tokens=6, adaptive="cost"),
                    generation=GenerationSpec(max_new_tokens=16, ignore_eos=True))
    generator = toolkit.build(recipe, target=target, tokenizer=tokenizer)
    assert generator.batchable
    together = generator.generate(texts)  # a list of prompts is a batch
    alone = toolkit.build(recipe, target=target, tokenizer=tokenizer)
    assert [r.token_ids for r in together] == [alone.generate(t).token_ids for t in texts]
    assert len(generator._persistent_drafter.cached_requests) == 5  # the rows' memory is shared and kept
    with pytest.raises(toolkit.errors.ConfigError):
        generator.generate_batch(texts, batch_size=0)
    tree = toolkit.build(recipe.replace(spec=SpeculationSpec(drafter="suffix", tree=True)), target=target,
                         tokenizer=tokenizer)
    assert not tree.batchable and len(tree.generate_batch(texts[:2])) == 2  # one at a time


def test_sampling_per_row_follows_the_target():
    from scipy.stats import chisquare

    target = tiny_llama(seed=4, vocab=12, initializer_range=0.3)
    prompt = make_prompt(2, vocab=12, length=6)
    with torch.no_grad():  # the law of the 2nd token (the 1st comes from the prefill, the 2nd from a batched round)
        p1 = target(prompt).logits[0, -1].softmax(-1).double()
        seq = torch.cat([prompt.expand(12, -1), torch.arange(12).view(-1, 1)], dim=1)
        p2 = (p1[:, None] * target(seq).logits[:, -1].softmax(-1).double()).sum(0).numpy()
    counts = np.zeros(12)
    decoder = batch_decoder(target, NGramDrafter, VerifyCost(list(FLAT), learn=False), num_draft_tokens=2,
                            batch_size=8)
    for chunk in range(50):  # 400 rows, 8 per forward, every row its own seed
        gen = GenerationSpec(max_new_tokens=2, do_sample=True, ignore_eos=True, seed=chunk * 8)
        for ids, _ in decoder.decode_batch([prompt] * 8, gen):
            counts[ids[1]] += 1
    assert chisquare(counts, p2 / p2.sum() * counts.sum()).pvalue > 0.01


def test_prompt_file_and_batched_run_with_baselines(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from eval.batch_run import markdown, run_batch, write_batch_results
    from toolkit.errors import ConfigError
    from toolkit.measure.prompts import load_prompt_file, load_suite

    path = tmp_path / "p.jsonl"
    texts = [" ".join(f"t{int(i)}" for i in p[0]) for p in prompts(3)]
    path.write_text("\n".join([json.dumps({"prompt": texts[0]}), json.dumps(texts[1]), "",
                               json.dumps({"messages": [{"role": "user", "content": texts[2]}]})]))
    loaded = load_prompt_file(path)
    assert loaded[:2] == texts[:2] and loaded[2] == [{"role": "user", "content": texts[2]}]
    suite = load_suite(str(path))  # a JSONL file is a prompt suite too (a recipe's `prompts`)
    assert [(p.id, p.kind) for p in suite] == [("prompt-1", "text"), ("prompt-2", "text"), ("prompt-3", "chat")]
    for bad, where in (("{not json", "--prompts:1"), ('{"prompt": 3}', "--prompts:1"), ("", "--prompts")):
        path.write_text(bad)
        with pytest.raises(ConfigError) as excinfo:
            load_prompt_file(path)
        assert excinfo.value.field == where
    target = tiny_llama(seed=0, **INIT)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(128)}, unk_token="t0")), pad_token="t0")
    recipe = Recipe(name="batch", target=ModelSpec(device="cpu"), draft=None,
                    spec=SpeculationSpec(drafter="lookup", num_draft_tokens=4, adaptive="cost"),
                    generation=GenerationSpec(max_new_tokens=12, ignore_eos=True))
    result = run_batch(toolkit.build(recipe, target=target, tokenizer=tokenizer), texts, batch_size=2, compare=True,
                       repeats=1)
    assert result["rows_identical_to_single"] == [True] * 3 and result["batched"]
    assert set(result["summary"]) == {"ours-batch", "hf-batch-ar", "ours-single"}
    assert all(s["new_tokens"] == 36 for s in result["summary"].values())  # HF's rows too: same prompts, same length
    assert "hf-batch-ar" in markdown(result)
    # runs of one recipe over two prompt sources land in two files, never over each other
    first = write_batch_results({**result, "prompts_source": "repeat"}, tmp_path / "out")
    second = write_batch_results({**result, "prompts_source": "../my prompts"}, tmp_path / "out")
    assert first.name == f"batch-{result['config_hash']}-repeat-batch2.json"
    assert second.name == f"batch-{result['config_hash']}-my_prompts-batch2.json"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [first.name, first.with_suffix(".md").name, second.name, second.with_suffix(".md").name])


def test_streaming_llm_per_row_equals_each_prompt_alone_under_the_policy():
    """StreamingLLM (absolute positions, exact window) runs per row in a batch (the static cache's ring): every row's
    greedy output is what the single-sequence decoder gives that prompt under the same policy, with prompts longer
    than the window, rows at different positions, and the batch cache bounded by the policy's budget, not the
    length."""
    target = tiny_llama(seed=0, **INIT)
    recipe = Recipe.from_dict({"name": "stream-batch", "target": {"device": "cpu"}, "draft": None,
                               "kv": {"policy": "streaming", "sink_tokens": 2, "window": 10, "compress_interval": 4},
                               "spec": {"drafter": "lookup", "num_draft_tokens": 4},
                               "generation": {"max_new_tokens": 72, "ignore_eos": True}})
    generator = toolkit.build(recipe, target=target, tokenizer=None)
    assert generator.batchable
    batch = prompts(5)  # 12..20 tokens: every prompt is longer than sinks + window
    alone = [generator.generate(p).token_ids for p in batch]
    rows = generator.generate_batch(batch, batch_size=3)
    assert [r.token_ids for r in rows] == alone
    # ... and what the policy's own single-sequence cache (compressing every 4 tokens) gives each prompt
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.kv.rows import SingleRowCache
    from toolkit.speculative.stats import GenerationStats

    policy = generator.target_policy
    for prompt, ids in zip(batch, alone):
        decoder = SpeculativeDecoder(target, RowDrafters(lambda: LookupDrafter(max_cached_requests=0)),
                                     target_policy=policy)
        decoder._new_cache = lambda prompts, gen: SingleRowCache(policy, target)
        stats = GenerationStats()
        assert [t for chunk in decoder.decode(prompt, recipe.generation, stats) for t in chunk] == ids
        assert isinstance(decoder.cache, SingleRowCache) and stats.compressions_target > 0
    per_token = 2 * target.config.num_hidden_layers * target.config.num_key_value_heads * 4 * (
        target.config.hidden_size // target.config.num_attention_heads)
    # the rows run on the static cache's StreamingLLM ring: sinks + window + the widest forward (K + 1) slots per
    # row (+ the SPAN_STEP slack of a dynamic span), whatever the generation length; uncompressed a row would hold
    # 20 + 72 positions
    from toolkit.kv.static import SPAN_STEP, capacity_for

    widest = recipe.spec.num_draft_tokens + 1
    slots = 2 + 10 + widest + SPAN_STEP  # per row, whatever the length
    peak = max(r.stats.peak_kv_bytes_batch for r in rows)
    assert peak % (per_token * slots) == 0 and 3 <= peak // (per_token * slots) <= 4  # the rows (+ a spare one)
    assert slots < capacity_for(20 + 72 + widest) + SPAN_STEP  # a row of the uncompressed static cache
    reindex = recipe.replace(kv=KVSpec.from_dict({"policy": "streaming", "sink_tokens": 2, "window": 10,
                                                  "position_mode": "reindex"}, "kv"))
    assert toolkit.build(reindex, target=target, tokenizer=None).batchable  # per-row slots (test_static_stream.py)
