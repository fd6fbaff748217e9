"""The toolkit's decoder inside HF ``generate`` (``custom_generate=toolkit.hf.speculative(...)``, toolkit/hf/).

Greedy output equals HF's own ``generate`` token for token on 12 architectures (lookup drafter and AR), the output
types and layouts are HF's (tensor / ``GenerateDecoderOnlyOutput``, left-padded batches padded after EOS), the
streamer sees the same tokens, every refused field raises one ConfigError naming it, and sampling under
temperature / top-k / top-p draws from the exact processed target distribution (chi-square, fixed seeds).
"""

from __future__ import annotations

import gc
import weakref
from itertools import chain

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_llama
from test_architectures import ARCHS, tiny
from test_decoder import eos_disabled
from test_sampling_stats import chisquare_p
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import toolkit.hf
from toolkit.errors import ConfigError
from toolkit.hf import custom_generate

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 16
LOOKUP = {"drafter": "lookup", "adaptive": "constant", "num_draft_tokens": 4, "max_cached_requests": 0}


def repetitive_prompt(seed: int = 1, vocab: int = 128) -> torch.Tensor:
    """``(1, 15)``: six tokens three times (the last cut), so the lookup drafter has matches to propose."""
    base = torch.randint(1, vocab, (6,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:3]]).view(1, -1)


def both(model, input_ids, custom, **kwargs):
    """``(HF's own generate, generate with custom_generate=custom)`` for the same arguments."""
    with torch.no_grad():
        return model.generate(input_ids, **kwargs), model.generate(input_ids, custom_generate=custom, **kwargs)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ends += 1


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


# ------------------------------------------------------------------------------------------------ greedy = HF
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_is_token_identical_to_hf_generate(arch):
    model, prompt = tiny(arch), repetitive_prompt()
    mask = torch.ones_like(prompt)  # prompt ids may equal pad_token_id (phi3)
    with eos_disabled(model):
        for custom in (toolkit.hf.speculative(**LOOKUP), toolkit.hf.speculative("none")):
            ours_vs_hf = both(model, prompt, custom, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
            assert ours_vs_hf[1].shape == (1, prompt.shape[1] + NEW)
            assert torch.equal(*ours_vs_hf)
    assert custom.recipe.spec.adaptive == "constant"  # AR: no cost curve to measure
    assert custom.last_stats[0].tokens_per_round == 1.0  # the AR recipe drafted nothing


def test_the_cost_aware_default_stays_exact(llama):
    prompt = repetitive_prompt()
    with eos_disabled(llama):
        lookup = toolkit.hf.speculative(**LOOKUP)
        hf, ours = both(llama, prompt, lookup, max_new_tokens=NEW)
        assert torch.equal(hf, ours) and lookup.last_stats[0].drafted > 0
        default = toolkit.hf.speculative()  # lookup, K up to 16, cost-aware verify length (measures the curve once)
        assert torch.equal(hf, both(llama, prompt, default, max_new_tokens=NEW)[1])


def test_a_draft_model_and_a_kv_policy_run_through_the_recipe(llama):
    prompt = repetitive_prompt()
    draft = perturbed_copy(llama, scale=0.1)
    with eos_disabled(llama):
        custom = toolkit.hf.speculative("draft_model", adaptive="constant", num_draft_tokens=3, draft_model=draft)
        hf, ours = both(llama, prompt, custom, max_new_tokens=NEW)
        assert torch.equal(hf, ours) and custom.last_stats[0].draft_forwards > 0
        policy = {"policy": "streaming", "sink_tokens": 2, "window": 12, "compress_interval": 2}
        window = toolkit.hf.speculative("none", kv=policy)  # absolute positions, exact window: the static ring
        llama.generate(prompt, max_new_tokens=NEW, custom_generate=window)
        stats = window.last_stats[0]
        config = llama.config
        per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * 4 * (
            config.hidden_size // config.num_attention_heads)
        # the ring holds sinks + window + the widest forward (+ a span's slack), not the capacity of an uncompressed
        # static cache (capacity_for(prompt + new) = 256 slots)
        assert stats.new_tokens == NEW and 0 < stats.peak_kv_bytes_target < per_slot * 256
        rolling = toolkit.hf.speculative("none", kv={**policy, "exact_window": False})  # compacted at commit points
        llama.generate(prompt, max_new_tokens=NEW, custom_generate=rolling)
        assert rolling.last_stats[0].compressions_target > 0 and rolling.last_stats[0].new_tokens == NEW


def test_eos_ids_stop_like_hf_and_max_length_counts_the_prompt(llama):
    prompt = repetitive_prompt()
    with eos_disabled(llama):
        reference = llama.generate(prompt, max_new_tokens=NEW)[0, prompt.shape[1]:].tolist()
    custom = toolkit.hf.speculative(**LOOKUP)
    for eos in (reference[6], [reference[9], reference[6]]):
        hf, ours = both(llama, prompt, custom, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
        stop = min(i for i, tok in enumerate(reference) if tok in ([eos] if isinstance(eos, int) else eos))
        assert torch.equal(hf, ours) and ours.shape[1] == prompt.shape[1] + stop + 1
        assert custom.last_stats[0].finish_reason == "eos"
    with eos_disabled(llama):
        hf, ours = both(llama, prompt, custom, max_length=prompt.shape[1] + 5)
    assert torch.equal(hf, ours) and ours.shape[1] == prompt.shape[1] + 5


# ------------------------------------------------------------------------------------------------ HF's outputs
def test_return_dict_in_generate_gives_hf_output_with_sequences(llama):
    prompt = repetitive_prompt()
    with eos_disabled(llama):
        hf, ours = both(llama, prompt, toolkit.hf.speculative(**LOOKUP), max_new_tokens=NEW,
                        return_dict_in_generate=True)
    assert type(ours) is GenerateDecoderOnlyOutput and torch.equal(ours.sequences, hf.sequences)
    assert ours.scores is None and ours.logits is None


def test_the_streamer_receives_the_same_tokens_in_fewer_puts(llama):
    prompt = repetitive_prompt()
    hf_stream, our_stream = Recorder(), Recorder()
    custom = toolkit.hf.speculative("draft_model", adaptive="constant", num_draft_tokens=3,
                                    draft_model=perturbed_copy(llama, scale=0.1))
    with eos_disabled(llama), torch.no_grad():
        hf = llama.generate(prompt, max_new_tokens=NEW, streamer=hf_stream)
        ours = llama.generate(prompt, max_new_tokens=NEW, streamer=our_stream, custom_generate=custom)
    assert torch.equal(hf, ours)
    assert our_stream.puts[0] == hf_stream.puts[0] == prompt[0].tolist()  # HF puts the prompt itself
    new = ours[0, prompt.shape[1]:].tolist()
    assert list(chain(*our_stream.puts[1:])) == list(chain(*hf_stream.puts[1:])) == new
    assert len(our_stream.puts) < len(hf_stream.puts) and our_stream.ends == hf_stream.ends == 1


def test_a_left_padded_batch_matches_hf_batched_generate(llama):
    rows = [repetitive_prompt(1)[0], repetitive_prompt(2)[0, 4:], repetitive_prompt(3)[0, 2:]]
    width = max(len(r) for r in rows)
    input_ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    with eos_disabled(llama):
        solo = [llama.generate(r.view(1, -1), max_new_tokens=NEW)[0, len(r):].tolist() for r in rows]
    eos = solo[1][3]  # row 1 stops early; the others run on and row 1 is padded, as HF does
    for batch_size in (None, 1):  # batched speculative decoding, then row by row
        custom = toolkit.hf.speculative(**LOOKUP, batch_size=batch_size)
        hf, ours = both(llama, input_ids, custom, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
                        pad_token_id=0)
        assert torch.equal(hf, ours)
        assert ours[1, width:].tolist() == solo[1][:solo[1].index(eos) + 1] + [0] * (NEW - solo[1].index(eos) - 1)


# ------------------------------------------------------------------------------------------------ refusals
class Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.roll(1, -1)


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


REFUSED = {
    "repetition_penalty": {"repetition_penalty": 1.3},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
    "min_new_tokens": {"min_new_tokens": 4, "eos_token_id": 5},
    "min_length": {"min_length": 18, "eos_token_id": 5},
    "bad_words_ids": {"bad_words_ids": [[7]]},
    "num_beams": {"num_beams": 2},
    "penalty_alpha": {"penalty_alpha": 0.6, "top_k": 4},
    "min_p": {"do_sample": True, "min_p": 0.1},
    "typical_p": {"do_sample": True, "typical_p": 0.5},
    "max_time": {"max_time": 10.0},
    "output_scores": {"output_scores": True, "return_dict_in_generate": True},
    "output_logits": {"output_logits": True, "return_dict_in_generate": True},
    "output_attentions": {"output_attentions": True, "return_dict_in_generate": True},
    "logits_processor": {"logits_processor": LogitsProcessorList([Shift()])},
    "stopping_criteria": {"stopping_criteria": StoppingCriteriaList([Never()])},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_each_unsupported_field_is_one_clear_error(llama, field):
    with pytest.raises(ConfigError, match=rf"^{field}: .*not supported by toolkit.hf.speculative.*supported: "
                                          r"max_new_tokens"):
        llama.generate(repetitive_prompt(), max_new_tokens=4, custom_generate=toolkit.hf.speculative(**LOOKUP),
                       **REFUSED[field])


def test_a_quantized_hf_cache_is_refused_for_the_toolkits_own():
    """(HF builds a quantized cache before calling custom_generate, so this needs optimum-quanto; read directly.)"""
    from transformers import GenerationConfig

    from toolkit.hf.request import read_request

    config = GenerationConfig(max_length=20, cache_implementation="quantized")
    with pytest.raises(ConfigError, match="^cache_implementation: 'quantized' .*kv=\\{'policy': 'quantized'"):
        read_request(repetitive_prompt(), [], [], config, {})


def test_inputs_the_decoder_cannot_take_are_refused(llama):
    custom, prompt = toolkit.hf.speculative(**LOOKUP), repetitive_prompt()
    with pytest.raises(ConfigError, match="^attention_mask: .*left padding"):
        llama.generate(prompt, attention_mask=torch.ones_like(prompt).index_fill(1, torch.tensor([14]), 0),
                       max_new_tokens=4, custom_generate=custom)
    with pytest.raises(ConfigError, match="^streamer: .*batch of one row"):
        llama.generate(prompt.repeat(2, 1), max_new_tokens=4, custom_generate=custom, streamer=Recorder())
    with pytest.raises(ConfigError, match="^past_key_values: 'a cache holding 15 tokens'"):
        cache = llama(prompt, use_cache=True).past_key_values
        llama.generate(prompt, past_key_values=cache, max_new_tokens=4, custom_generate=custom)
    with pytest.raises(ConfigError, match="^inputs_embeds: "):
        llama.generate(inputs_embeds=llama.get_input_embeddings()(prompt), max_new_tokens=4, custom_generate=custom)
    with pytest.raises(ConfigError, match=r"^generation.max_new_tokens: .*exceeds the target's context of 256"):
        llama.generate(prompt, max_new_tokens=300, custom_generate=custom)


def test_the_factory_checks_its_arguments():
    with pytest.raises(ConfigError, match="^spec.drafter: unknown value 'lookahead'"):
        toolkit.hf.speculative("lookahead")
    with pytest.raises(ConfigError, match="^spec.max_ngram: applies to drafter ngram"):
        toolkit.hf.speculative("lookup", max_ngram=5)
    with pytest.raises(ConfigError, match="^draft_model: drafter 'draft_model' drafts with a model"):
        toolkit.hf.speculative("draft_model")
    with pytest.raises(ConfigError, match="^draft_model: drafter 'lookup' uses no draft model"):
        toolkit.hf.speculative("lookup", draft_model=tiny_llama())
    with pytest.raises(ConfigError, match="^kv.policy: unknown policy 'lru'"):
        toolkit.hf.speculative(kv="lru")


# ------------------------------------------------------------------------------------------------ sampling
def exact_pairs(model, prompt: torch.Tensor, warpers: LogitsProcessorList) -> np.ndarray:
    """P(first two new tokens) ``(vocab * vocab,)`` under HF's own warpers applied to the model's logits."""
    def dist(ids):
        with torch.no_grad():
            return warpers(ids, model(ids).logits[:, -1].double()).softmax(-1)[0]

    first = dist(prompt)
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for tok in first.nonzero().flatten().tolist():
        joint[tok] = first[tok] * dist(torch.cat([prompt, prompt.new_tensor([[tok]])], dim=1))
    return joint.flatten().numpy()


def pair_counts(sequences: torch.Tensor, start: int, vocab: int) -> np.ndarray:
    pairs = sequences[:, start] * vocab + sequences[:, start + 1]
    return np.bincount(pairs.numpy(), minlength=vocab * vocab)


def fit_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` against ``probs`` over its support (0.0 if any draw lies outside it)."""
    support = probs > 0
    if counts[~support].any():
        return 0.0
    return chisquare_p(counts[support], probs[support] / probs[support].sum())


def test_single_row_sampling_is_exact_and_seeded():
    """One request per call (the single-sequence decoder, lookup drafts of K = 4 verified by rejection sampling):
    the first two tokens of 400 calls fit ``P(x1) P(x2 | x1)`` under HF's temperature, top-k and top-p warpers and
    reject the untempered distribution; ``torch.manual_seed`` makes a call reproducible."""
    model, prompt = tiny_llama(vocab=16), repetitive_prompt(vocab=16)
    custom = toolkit.hf.speculative(**LOOKUP)
    torch.manual_seed(0)
    rows, drafted = [], 0
    with eos_disabled(model), torch.no_grad():
        for _ in range(400):
            rows.append(model.generate(prompt, do_sample=True, temperature=0.6, top_k=8, top_p=0.9,
                                       max_new_tokens=3, custom_generate=custom)[0])  # room to draft token 2
            drafted += custom.last_stats[0].drafted
        torch.manual_seed(7)
        again = [model.generate(prompt, do_sample=True, max_new_tokens=8, custom_generate=custom) for _ in range(2)]
        torch.manual_seed(7)
        assert torch.equal(again[0], model.generate(prompt, do_sample=True, max_new_tokens=8, custom_generate=custom))
    assert not torch.equal(*again) and drafted > 50
    counts = pair_counts(torch.stack(rows), prompt.shape[1], 16)
    warpers = [TemperatureLogitsWarper(0.6), TopKLogitsWarper(8), TopPLogitsWarper(0.9)]
    assert fit_p(counts, exact_pairs(model, prompt, LogitsProcessorList(warpers))) > 0.01
    assert fit_p(counts, exact_pairs(model, prompt, LogitsProcessorList(warpers[1:]))) < 1e-6


@pytest.mark.slow
@pytest.mark.heavy  # ~8 s; the single-row sampling test runs the same processors
def test_batched_sampling_draws_from_hf_processed_distribution(llama):
    """2048 rows (``num_return_sequences``) through batched decoding, 32 rows per forward: the first two tokens fit
    the distribution of HF's warpers, including HF's sampling default top_k=50; the untempered one is rejected."""
    prompt, n = repetitive_prompt(), 2048
    custom = toolkit.hf.speculative(**LOOKUP, batch_size=32)
    torch.manual_seed(0)
    with eos_disabled(llama):
        out = llama.generate(prompt, do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=3,
                             num_return_sequences=n, custom_generate=custom)
    assert out.shape == (n, prompt.shape[1] + 3) and len(custom.last_stats) == n
    counts = pair_counts(out, prompt.shape[1], 128)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]
    assert fit_p(counts, exact_pairs(llama, prompt, LogitsProcessorList(warpers))) > 0.01
    assert fit_p(counts, exact_pairs(llama, prompt, LogitsProcessorList(warpers[1:]))) < 1e-6


# ------------------------------------------------------------------------------------------------ state per model
def test_what_a_model_learned_is_kept_per_model_and_freed_with_it(monkeypatch):
    import toolkit.speculative_lm

    loads = []
    original = toolkit.speculative_lm.load_or_measure
    monkeypatch.setattr(toolkit.speculative_lm, "load_or_measure", lambda *a, **k: loads.append(1) or original(*a, **k))
    model, prompt = tiny_llama(), repetitive_prompt()
    with eos_disabled(model):
        for _ in range(2):  # two factories with the same settings: the second reuses the model's curve and memory
            model.generate(prompt, max_new_tokens=8, custom_generate=toolkit.hf.speculative(max_cached_requests=4))
    assert len(loads) == 1
    (state,) = custom_generate._STATE[model].values()
    assert state["_persistent_drafter"] is not None and state["_verify_cost"] is not None
    alive, before = weakref.ref(model), len(custom_generate._STATE)
    del model, state
    gc.collect()
    assert alive() is None and len(custom_generate._STATE) == before - 1


# ------------------------------------------------------------------------------------------------ embedded model
@pytest.mark.slow
def test_embedded_model_greedy_is_token_identical_to_hf(embedded):
    """The lookup drafter (constant K: the cost-aware length is tested on tiny models; measuring the embedded
    model's curve would cost seconds here) and the shipped EAGLE head as ``draft_model``, 24 tokens."""
    from toolkit.eagle.checkpoint import load_head, resolve_head

    model, tokenizer = embedded
    messages = [{"role": "user", "content": "Write the numbers from one to ten, separated by commas."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    head = load_head(resolve_head("embedded"), model, dtype=torch.float32)
    eagle = toolkit.hf.speculative("eagle", adaptive="constant", num_draft_tokens=3, draft_model=head)
    with eos_disabled(model):
        hf, ours = both(model, inputs["input_ids"], toolkit.hf.speculative(adaptive="constant", num_draft_tokens=4),
                        max_new_tokens=24,
                        attention_mask=inputs["attention_mask"])
        assert torch.equal(hf, ours) and ours.shape[1] == inputs["input_ids"].shape[1] + 24
        with torch.no_grad():
            drafted = model.generate(**inputs, max_new_tokens=24, custom_generate=eagle)
    assert torch.equal(hf, drafted) and eagle.last_stats[0].accepted > 0
