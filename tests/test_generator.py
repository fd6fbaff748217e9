"""The Python API: ``toolkit.build(recipe)`` -> SpeculativeLM.generate / generate_stream.

Fast tests wrap a tiny random Llama in a word-level tokenizer built on the spot (same vocabulary size, so the
SpeculativeLM works end to end); slow tests use the embedded SmolLM2 model and its real BPE tokenizer (stop strings
that fall inside a token, chat templates).
"""

from __future__ import annotations

import re

import pytest
from conftest import perturbed_copy, tiny_llama
from test_decoder import hf_greedy

import toolkit
from toolkit.errors import ConfigError
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec

VOCAB = 128


def word_tokenizer(vocab: int = VOCAB):
    """A word-level fast tokenizer over ``vocab`` distinct words of the Apache-2.0 license (ids 0-2 special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = []
    for word in re.findall(r"[a-z]+", open("/usr/share/common-licenses/Apache-2.0").read().lower()):
        if word not in words:
            words.append(word)
    table = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in words[: vocab - 3]:
        table[word] = len(table)
    assert len(table) == vocab
    backend = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def recipe(drafter: str = "draft_model", k: int = 3, **generation) -> Recipe:
    generation.setdefault("max_new_tokens", 30)
    return Recipe(name="test", draft=ModelSpec(precision="fp32"),
                  spec=SpeculationSpec(drafter=drafter, num_draft_tokens=k), generation=GenerationSpec(**generation))


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.1, seed=1)
    return target, word_tokenizer(), draft


@pytest.fixture(scope="module")
def tiny_generator(tiny):
    target, tokenizer, draft = tiny
    return toolkit.build(recipe(ignore_eos=True), target=target, tokenizer=tokenizer, draft_model=draft)


PROMPT = "licensed under the apache license version you may not use this file except in compliance with the license"


# ------------------------------------------------------------------------------------------------------ fast
def test_generate_matches_hf_greedy_and_fills_stats(tiny, tiny_generator):
    target, tokenizer, _ = tiny
    result = tiny_generator.generate(PROMPT, max_new_tokens=30)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert result.prompt_ids == input_ids[0].tolist()
    assert result.token_ids == hf_greedy(target, input_ids, 30)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats
    assert stats.new_tokens == 30 and stats.prompt_tokens == input_ids.shape[1]
    assert stats.rounds >= 2 and 0 < stats.accepted < stats.drafted
    assert stats.ttft_ms > 0 and stats.total_ms >= stats.ttft_ms
    assert stats.kv_bytes_target > 0 and stats.kv_bytes_draft > 0


@pytest.mark.parametrize("overrides", [
    {},
    {"do_sample": True, "seed": 3, "temperature": 0.5},
    {"max_new_tokens": 1},
], ids=["greedy", "sampling", "one_token"])
def test_generate_stream_concatenates_to_generate_text(tiny_generator, overrides):
    from toolkit.speculative.stats import GenerationStats

    full = tiny_generator.generate(PROMPT, **overrides)
    stats = GenerationStats()
    pieces = list(tiny_generator.generate_stream(PROMPT, stats=stats, **overrides))
    assert "".join(pieces) == full.text
    assert stats.new_tokens == full.stats.new_tokens and stats.rounds == full.stats.rounds  # the round statistics
    assert full.text  # something was generated
    if overrides.get("max_new_tokens", 30) > 5:
        assert len(pieces) > 1  # streamed incrementally, not in one final piece


def test_stop_string_ends_the_output_right_after_it(tiny_generator, tiny):
    _, tokenizer, _ = tiny
    full = tiny_generator.generate(PROMPT, max_new_tokens=30)
    words = full.text.split()
    # the first 3 letters of a long word from the middle of the output: the stop string ends inside a token, so
    # the text must be cut inside the decoded text of the last token
    word = next(w for w in words[len(words) // 2:] + words if len(w) >= 5)
    stop = word[:3]
    first = full.text.index(stop)
    assert full.text[first + len(stop)].isalpha()
    result = tiny_generator.generate(PROMPT, max_new_tokens=30, stop_strings=[stop])
    assert result.text == full.text[: first + len(stop)]
    assert result.stats.finish_reason == "stop_string"
    # token ids: the shortest prefix of the full output whose text holds the stop string
    n = len(result.token_ids)
    assert result.token_ids == full.token_ids[:n]
    assert stop not in tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)
    streamed = "".join(tiny_generator.generate_stream(PROMPT, max_new_tokens=30, stop_strings=[stop]))
    assert streamed == result.text


def test_eos_override_stops_at_that_token(tiny_generator):
    full = tiny_generator.generate(PROMPT, max_new_tokens=30)
    index = next(i for i in range(4, 30) if full.token_ids[i] not in full.token_ids[:i])
    eos = full.token_ids[index]
    result = tiny_generator.generate(PROMPT, max_new_tokens=30, ignore_eos=False, eos_token_id=[eos])
    assert result.token_ids == full.token_ids[: index + 1]
    assert result.stats.finish_reason == "eos"


@pytest.mark.parametrize("drafter", ["ngram", "none", "self"])
def test_every_drafter_through_the_api_matches_greedy(tiny, drafter):
    target, tokenizer, draft = tiny
    generator = toolkit.build(recipe(drafter, ignore_eos=True), target=target, tokenizer=tokenizer,
                              draft_model=draft)
    result = generator.generate(PROMPT + " " + PROMPT, max_new_tokens=20)
    reference = hf_greedy(target, tokenizer(PROMPT + " " + PROMPT, return_tensors="pt").input_ids, 20)
    assert result.token_ids == reference
    if drafter in ("ngram", "none"):
        assert generator.draft_model is None
    if drafter == "none":
        assert result.stats.drafted == 0 and result.stats.tokens_per_round == 1.0


def test_unknown_or_invalid_generation_argument_is_a_config_error(tiny_generator):
    with pytest.raises(ConfigError, match=r"generation\.max_tokens.*allowed:.*max_new_tokens"):
        tiny_generator.generate(PROMPT, max_tokens=5)
    with pytest.raises(ConfigError, match=r"generation\.max_new_tokens"):
        tiny_generator.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"generation\.temperature"):
        tiny_generator.generate(PROMPT, temperature=0.0)
    with pytest.raises(ConfigError, match="prompt"):
        tiny_generator.generate(42)


# ------------------------------------------------------------------------------------------------------ slow
@pytest.fixture(scope="module")
def embedded_generator(embedded):
    model, tokenizer = embedded
    return toolkit.build(recipe("ngram", k=4, max_new_tokens=32), target=model, tokenizer=tokenizer)


@pytest.mark.slow
@pytest.mark.heavy  # ~7 s on the embedded model; the tiny-model stop-string tests prove the logic
def test_embedded_stop_strings_end_output_at_the_right_place(embedded_generator):
    prompt = [{"role": "user", "content": "List the first ten prime numbers, separated by commas."}]
    full = embedded_generator.generate(prompt, ignore_eos=True)
    text = full.text
    assert len(text) > 20
    # a stop string that starts inside the text (not at a token boundary in general): 3 characters from the middle
    middle = len(text) // 2
    stop = text[middle: middle + 3]
    assert stop.strip(), text
    first = text.index(stop)
    result = embedded_generator.generate(prompt, ignore_eos=True, stop_strings=[stop, "@@never@@"])
    assert result.text == text[: first + len(stop)]
    assert result.text.endswith(stop) and result.text.count(stop) == 1
    assert result.stats.finish_reason == "stop_string"
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) < len(full.token_ids)
    streamed = "".join(embedded_generator.generate_stream(prompt, ignore_eos=True, stop_strings=[stop]))
    assert streamed == result.text


# 12 s; the tiny-model stream test proves the same path; make test-system runs it
@pytest.mark.slow
@pytest.mark.heavy
def test_embedded_stream_equals_generate_text(embedded_generator):
    prompts = [
        [{"role": "user", "content": "Write a haiku about autumn in Kyoto. Use an em dash — and quotes «like this»."}],
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ]
    # greedy on the chat prompt, sampling on the code prompt (each mode, each prompt kind once)
    for prompt, overrides in zip(prompts, ({}, {"do_sample": True, "seed": 11, "temperature": 0.8})):
        full = embedded_generator.generate(prompt, **overrides)
        pieces = list(embedded_generator.generate_stream(prompt, **overrides))
        assert "".join(pieces) == full.text
        assert len(pieces) > 1


@pytest.mark.slow
def test_embedded_eos_ends_a_chat_reply(embedded_generator):
    """With the tokenizer's own EOS (<|im_end|>), a short chat reply ends with finish_reason eos."""
    prompt = [{"role": "user", "content": "Reply with the single word: yes"}]
    result = embedded_generator.generate(prompt, max_new_tokens=48)
    assert result.stats.finish_reason == "eos"
    assert result.token_ids[-1] in embedded_generator.eos_token_ids(embedded_generator.recipe.generation)
    assert len(result.token_ids) < 48
