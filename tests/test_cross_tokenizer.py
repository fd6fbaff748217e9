"""A draft with another tokenizer (toolkit/speculative/drafters/cross_tokenizer.py): greedy output is target AR,
sampling is exact (one-hot drafts), the translation of a right draft is accepted whole, and `drafter: draft_model`
picks it by itself when the vocabularies differ."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from test_decoder import INIT, hf_greedy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import toolkit
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.engine.planner import ConstantK
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.speculative.drafters.cross_tokenizer import CrossTokenizerDrafter
from toolkit.speculative.stats import GenerationStats

CHARS = list("t0123456789 ")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """The target's: one token per word ``t0`` .. ``t127``."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The draft's: one token per character of ``t0123456789 ``."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, **INIT)
    draft = tiny_llama(seed=1, vocab=len(CHARS), **INIT)
    prompt = torch.tensor([[5, 9, 13, 2, 5, 9, 13, 2, 5]])
    return target, draft, prompt, hf_greedy(target, prompt, 24)


def decode(target, drafter, prompt, **gen) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    spec = GenerationSpec(max_new_tokens=24, ignore_eos=True, **gen)
    ids = [t for c in SpeculativeDecoder(target, drafter, ConstantK(3)).decode(prompt, spec, stats) for t in c]
    return ids, stats


def test_greedy_output_is_target_ar(pair):
    target, draft, prompt, reference = pair
    with warnings.catch_warnings():  # the draft's cache goes in as `cache=` where transformers takes it
        warnings.simplefilter("error", FutureWarning)
        ids, stats = decode(target, CrossTokenizerDrafter(draft, char_tokenizer(), word_tokenizer()), prompt)
    assert ids == reference and stats.drafted > 0 and stats.draft_forwards > 0


class Oracle(CrossTokenizerDrafter):
    """Drafts the target's own continuation, as text of the draft's tokenizer (a perfect draft)."""

    def __init__(self, *args, truth: str, **kw):
        super().__init__(*args, **kw)
        self.truth = truth

    def draft_text(self, text: str, num_tokens: int) -> str:
        assert self.truth.startswith(text)
        return self.truth[len(text):][: num_tokens * 2]


def test_a_right_draft_is_translated_into_accepted_target_tokens(pair):
    target, draft, prompt, reference = pair
    words = word_tokenizer()
    truth = words.decode(prompt[0].tolist() + reference)
    ids, stats = decode(target, Oracle(draft, char_tokenizer(), words, truth=truth), prompt)
    assert ids == reference
    assert stats.acceptance_rate > 0.9  # boundary merges are the target's own: every whole drafted word holds


@pytest.mark.slow
@pytest.mark.heavy  # ~7 s of draws; the greedy tests prove the token mapping
def test_sampling_stays_exact(pair):
    from scipy.stats import chisquare

    target, draft, prompt, _ = pair
    small = tiny_llama(seed=4, vocab=12, initializer_range=0.3)  # 12 target words: a testable distribution
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(12)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = PreTrainedTokenizerFast(tokenizer_object=words)
    x = torch.tensor([[1, 5, 3, 1, 5]])
    with torch.no_grad():
        p1 = small(x).logits[0, -1].softmax(-1).double()
        seq = torch.cat([x.expand(12, -1), torch.arange(12).view(-1, 1)], dim=1)
        p2 = (p1[:, None] * small(seq).logits[:, -1].softmax(-1).double()).sum(0).numpy()
    counts = np.zeros(12)
    for seed in range(600):
        stats = GenerationStats()
        loop = SpeculativeDecoder(small, CrossTokenizerDrafter(draft, char_tokenizer(), words), ConstantK(2))
        gen = GenerationSpec(max_new_tokens=3, do_sample=True, ignore_eos=True, seed=seed)
        ids = [t for c in loop.decode(x, gen, stats) for t in c]
        counts[ids[1]] += 1
    expected = p2 / p2.sum() * counts.sum()
    rare = expected < 5  # pooled: the chi-square approximation needs >= 5 expected per cell
    observed = np.append(counts[~rare], counts[rare].sum())
    assert chisquare(observed, np.append(expected[~rare], expected[rare].sum())).pvalue > 0.01


def test_draft_model_recipe_translates_by_itself_and_hf_universal_assisted_runs(pair):
    from toolkit.measure.baselines import hf_generate

    target, draft, prompt, reference = pair
    words, chars = word_tokenizer(), char_tokenizer()
    recipe = Recipe(name="cross", target=ModelSpec(device="cpu"), draft=ModelSpec(device="cpu"),
                    spec=SpeculationSpec(drafter="draft_model", num_draft_tokens=3),
                    generation=GenerationSpec(max_new_tokens=24, ignore_eos=True))
    generator = toolkit.build(recipe, target=target, tokenizer=words, draft_model=draft, draft_tokenizer=chars)
    text = words.decode(prompt[0].tolist())
    out = generator.generate(text)
    assert out.token_ids == reference and out.stats.drafted > 0
    same = toolkit.build(recipe, target=target, tokenizer=words, draft_model=target, draft_tokenizer=words)
    assert same.draft_tokenizer is None  # one vocabulary: the plain draft-model drafter
    ids, _ = hf_generate(target, prompt, GenerationSpec(max_new_tokens=8, ignore_eos=True), [], method="assisted",
                         assistant_model=draft, tokenizer=words, assistant_tokenizer=chars)
    assert ids == reference[:8]
