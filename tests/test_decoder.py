"""The speculative decode loop (toolkit/engine/decoder.py) with every drafter, on tiny random models and (slow) on the
embedded SmolLM2 model.

The greedy identity of ``docs/design.md`` ("Lossless semantics"): greedy speculative output is token-identical to
the target's own greedy output (HF ``generate(do_sample=False)``, EOS disabled), with a draft that partly agrees so
both acceptances and rejections happen. Plus the cache invariant after rollback, the stop conditions and seeded
sampling.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import perturbed_copy, tiny_llama, tiny_neox

from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.planner import ConstantK, EmaK
from toolkit.recipe import GenerationSpec
from toolkit.speculative.drafters import DraftModel, NGramDrafter
from toolkit.speculative.stats import GenerationStats

NEW_TOKENS = 40
PROMPT_LEN = 12


# ------------------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def eos_disabled(model):
    """Temporarily give ``model`` a generation config without EOS (HF merges a passed config with the model's)."""
    old = model.generation_config
    config = copy.deepcopy(old)
    config.eos_token_id = None
    config.pad_token_id = 0
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = old


def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The AR reference: HF ``generate(do_sample=False)`` with EOS disabled."""
    with eos_disabled(model), torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens)  # explicit mask: prompt ids may equal pad_token_id
    ids = out[0, input_ids.shape[1]:].tolist()
    assert len(ids) == max_new_tokens
    return ids


def speculate(target, drafter, input_ids, controller=None, eos=(), should_stop=None, **gen):
    """Run the decode loop to the end; returns ``(new_ids, stats, chunks)``."""
    gen.setdefault("max_new_tokens", NEW_TOKENS)
    gen.setdefault("ignore_eos", not eos)
    spec = GenerationSpec(**gen)
    stats = GenerationStats()
    decoder = SpeculativeDecoder(target, drafter, controller or ConstantK(3))
    chunks = list(decoder.decode(input_ids, spec, stats, list(eos), should_stop))
    return [tok for chunk in chunks for tok in chunk], stats, chunks


def make_prompt(seed: int = 0, vocab: int = 128, length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


BUILDERS = {"llama": tiny_llama, "neox": tiny_neox}
# With the default initializer_range (0.02) a random tiny model's attention is nearly uniform, so it barely depends
# on positions: an off-by-one in position_ids went undetected. 0.2 makes attention (and the logits) peaked.
INIT = {"initializer_range": 0.2}


@pytest.fixture(scope="module")
def models():
    """{arch: (target, partly agreeing draft, prompt, AR reference)}, built once per module."""
    out = {}
    for arch, build in BUILDERS.items():
        target = build(seed=0, **INIT)
        draft = perturbed_copy(target, scale=0.1, seed=1)
        prompt = make_prompt(0)
        out[arch] = (target, draft, prompt, hf_greedy(target, prompt, NEW_TOKENS))
    return out


def assert_both_outcomes(stats: GenerationStats) -> None:
    assert stats.rounds >= 2
    assert stats.accepted > 0, "no draft token was ever accepted"
    assert stats.accepted < stats.drafted, "no draft token was ever rejected"


# ------------------------------------------------------------------------------------------------------ greedy equivalence
@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_draft_model_matches_ar(models, arch, k):
    target, draft, prompt, reference = models[arch]
    ids, stats, _ = speculate(target, DraftModel(draft), prompt, ConstantK(k))
    assert ids == reference
    assert_both_outcomes(stats)
    assert stats.committed == stats.accepted + stats.rounds
    assert stats.target_forwards == stats.rounds + 1  # one verify forward per round, plus the prefill
    assert max(stats.draft_lengths) == min(k, NEW_TOKENS - 1)


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_autoregressive_loop_matches_ar(models, arch):
    target, _, prompt, reference = models[arch]
    ids, stats, _ = speculate(target, None, prompt)
    assert ids == reference
    assert stats.drafted == 0 and stats.tokens_per_round == 1.0


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_ngram_drafter_matches_ar(models, arch):
    target, _, _, _ = models[arch]
    # a prompt with repeats, so prompt lookup finds matches (and is sometimes wrong)
    base = make_prompt(9, length=6)[0]  # seed chosen so that lookup is right sometimes and wrong sometimes
    prompt = torch.cat([base, base, base[:3]]).view(1, -1)
    reference = hf_greedy(target, prompt, NEW_TOKENS)
    ids, stats, _ = speculate(target, NGramDrafter(max_ngram=3, min_ngram=1), prompt, ConstantK(4))
    assert ids == reference
    assert_both_outcomes(stats)


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_self_drafter_at_lower_precision_matches_ar(models, arch):
    """The ``self`` drafter: the target's own weights at a lower precision (bf16 here; int8/int4 on the embedded
    model in the slow test). The bf16 copy of a random model disagrees with fp32 now and then."""
    target, _, prompt, reference = models[arch]
    low = copy.deepcopy(target).to(torch.bfloat16)
    ids, stats, _ = speculate(target, DraftModel(low), prompt, ConstantK(4))
    assert ids == reference
    assert stats.accepted > 0 and stats.rounds >= 2


def uncapped_lengths(stats: GenerationStats, chunks: list[list[int]], limit: int, k: int) -> list[int]:
    """Draft lengths of the rounds where ``max_new_tokens`` did not cap the draft length below ``k``."""
    out, generated = [], len(chunks[0])
    for length, chunk in zip(stats.draft_lengths, chunks[1:]):
        if limit - generated - 1 >= k:
            out.append(length)
        generated += len(chunk)
    return out


def test_ema_controller_grows_shrinks_and_clamps():
    def update(drafted: int, accepted: int) -> None:  # one row that drafted and verified `drafted` tokens
        row = SimpleNamespace(proposal=[0] * drafted, confidence=None, q=None)
        controller.update([row], drafted, [accepted], [0])

    controller = EmaK(3, k_min=2, k_max=5, decay=0.5)
    for _ in range(4):
        update(controller.next_k(), controller.next_k())  # everything accepted
    assert controller.next_k() == 5  # grew, clamped at k_max
    for _ in range(6):
        update(controller.next_k(), 0)  # everything rejected
    assert controller.next_k() == 2  # shrank, clamped at k_min
    update(0, 0)  # a round that drafted nothing changes nothing
    assert controller.next_k() == 2
    assert EmaK(9, k_min=1, k_max=4).next_k() == 4


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_adaptive_k_matches_ar(models, arch):
    target, draft, prompt, reference = models[arch]
    controller = EmaK(3, k_min=1, k_max=6, decay=0.5)
    ids, stats, chunks = speculate(target, DraftModel(draft), prompt, controller)
    assert ids == reference
    assert_both_outcomes(stats)
    lengths = uncapped_lengths(stats, chunks, NEW_TOKENS, 6)
    assert all(1 <= k <= 6 for k in lengths)
    if arch == "llama":  # this draft often disagrees with the Llama target: K shrinks from 3
        assert min(lengths) < 3, lengths
    else:  # ... and agrees well with the NeoX target: K grows from 3
        assert max(lengths) > 3, lengths


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_confidence_threshold_matches_ar(models, arch):
    target, draft, prompt, reference = models[arch]
    # a threshold at a low quantile of the draft's top probabilities stops some rounds early, not all
    with torch.no_grad():
        probs = draft(torch.cat([prompt, torch.tensor([reference])], dim=1)).logits[0].softmax(-1)
    threshold = float(probs.max(-1).values.quantile(0.1))
    ids, stats, chunks = speculate(target, DraftModel(draft, confidence_threshold=threshold), prompt, ConstantK(6))
    assert ids == reference
    assert stats.accepted > 0
    lengths = uncapped_lengths(stats, chunks, NEW_TOKENS, 6)
    assert min(lengths) < 6 <= max(lengths), lengths  # some rounds stopped early, some drafted all K


def test_greedy_equivalence_on_several_prompts_and_a_second_seed():
    target = tiny_llama(seed=5, layers=3, **INIT)
    draft = perturbed_copy(target, scale=0.15, seed=7)
    for seed in (10, 11, 12):
        prompt = make_prompt(seed, length=5 + seed)
        reference = hf_greedy(target, prompt, 24)
        ids, stats, _ = speculate(target, DraftModel(draft), prompt, ConstantK(3), max_new_tokens=24)
        assert ids == reference, seed


# ------------------------------------------------------------------------------------------------------ cache invariant
@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_caches_hold_exactly_the_committed_prefix_after_every_round(models, arch):
    """Between rounds, target cache = committed - 1 tokens; after a rejection the draft cache too; and the cached
    keys/values equal those of a fresh forward over the committed prefix (the rollback removed the right entries)."""
    target, draft_model, prompt, reference = models[arch]
    drafter = DraftModel(draft_model)
    decoder = SpeculativeDecoder(target, drafter, ConstantK(4))
    stats = GenerationStats()
    sequence = prompt[0].tolist()
    rejections = checked_content = 0
    prev_accepted = prev_drafted = 0
    chunks = decoder.decode(prompt, GenerationSpec(max_new_tokens=NEW_TOKENS, ignore_eos=True), stats)
    for chunk in chunks:
        sequence += chunk
        if len(sequence) - prompt.shape[1] >= NEW_TOKENS:
            break  # the final round may be truncated at max_new_tokens
        committed = len(sequence)
        assert decoder.cache.get_seq_length() == committed - 1
        round_drafted, round_accepted = stats.drafted - prev_drafted, stats.accepted - prev_accepted
        prev_drafted, prev_accepted = stats.drafted, stats.accepted
        if stats.rounds == 0:
            continue  # the prefill: the drafter has not run yet
        assert drafter.cache.held == [drafter.cache.get_seq_length()]  # the draft's own static cache, one row
        assert drafter.cache.get_seq_length() <= committed - 1
        if round_accepted < round_drafted:
            rejections += 1
            assert drafter.cache.get_seq_length() == committed - 1
        if stats.rounds % 3 == 1:  # compare contents with a fresh forward over the committed prefix
            prefix = torch.tensor([sequence[:-1]])
            for model, cache in ((target, decoder.cache), (draft_model, drafter.cache)):
                with torch.no_grad():
                    fresh = model(prefix, use_cache=True).past_key_values
                n = cache.get_seq_length()  # the target's static cache: slot = position; slots past n unused
                for layer, ref_layer in zip(cache.layers, fresh.layers):
                    torch.testing.assert_close(layer.keys[:, :, :n], ref_layer.keys[:, :, :n], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(layer.values[:, :, :n], ref_layer.values[:, :, :n], atol=1e-4,
                                               rtol=1e-4)
            checked_content += 1
    assert sequence[prompt.shape[1]:][:NEW_TOKENS] == reference[: len(sequence) - prompt.shape[1]]
    assert rejections >= 2 and checked_content >= 2


# ------------------------------------------------------------------------------------------------------ stop conditions
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_max_new_tokens_is_exact_with_ignore_eos(models, k, max_new):
    target, draft, prompt, reference = models["llama"]
    eos = [reference[0]]  # would stop at once, but ignore_eos wins
    ids, stats, _ = speculate(target, DraftModel(draft), prompt, ConstantK(k), eos=eos, ignore_eos=True,
                              max_new_tokens=max_new)
    assert ids == reference[:max_new]
    assert stats.new_tokens == max_new and stats.finish_reason == "length"


@pytest.mark.parametrize("k", [1, 3, 6])
def test_max_new_tokens_never_exceeded_under_sampling(models, k):
    target, draft, prompt, _ = models["neox"]
    for seed in range(3):
        drafter = DraftModel(draft, do_sample=True, generator=torch.Generator().manual_seed(seed + 100))
        ids, stats, _ = speculate(target, drafter, prompt, ConstantK(k), do_sample=True, seed=seed, max_new_tokens=9)
        assert len(ids) == 9 and stats.new_tokens == 9


def first_new_token_at(reference: list[int], start: int) -> tuple[int, int]:
    """(index, token) of the first token at index >= start that does not occur earlier in ``reference``."""
    for i in range(start, len(reference)):
        if reference[i] not in reference[:i]:
            return i, reference[i]
    raise AssertionError("no fresh token in the reference")


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_eos_stops_generation_right_after_it(models, arch, k):
    target, draft, prompt, reference = models[arch]
    index, eos = first_new_token_at(reference, 3)
    ids, stats, _ = speculate(target, DraftModel(draft), prompt, ConstantK(k), eos=[eos])
    assert ids == reference[: index + 1]  # EOS kept, nothing after it, even when the round accepted past it
    assert ids[-1] == eos and stats.finish_reason == "eos"


def test_should_stop_cuts_the_output(models):
    target, draft, prompt, reference = models["llama"]
    index, marker = first_new_token_at(reference, 5)

    def should_stop(new_ids):
        return new_ids.index(marker) + 1 if marker in new_ids else None

    ids, stats, _ = speculate(target, DraftModel(draft), prompt, ConstantK(5), should_stop=should_stop)
    assert ids == reference[: index + 1] and stats.finish_reason == "stop_string"


# ------------------------------------------------------------------------------------------------------ sampling
def sample_run(target, draft, prompt, seed, k=3, **gen):
    drafter = DraftModel(draft, do_sample=True, temperature=gen.get("temperature", 1.0), top_k=gen.get("top_k", 0),
                         top_p=gen.get("top_p", 1.0), generator=torch.Generator().manual_seed(seed + 1))
    return speculate(target, drafter, prompt, ConstantK(k), do_sample=True, seed=seed, **gen)


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_sampling_is_reproducible_under_a_seed(models, arch):
    target, draft, prompt, _ = models[arch]
    # random tiny models are near-uniform (top probability ~0.011 of 128): sharpen with a low temperature so that
    # p and q differ enough for rejections to happen
    a, stats_a, _ = sample_run(target, draft, prompt, seed=7, temperature=0.3)
    b, _, _ = sample_run(target, draft, prompt, seed=7, temperature=0.3)
    c, _, _ = sample_run(target, draft, prompt, seed=8, temperature=0.3)
    assert a == b
    assert a != c
    assert stats_a.accepted > 0 and stats_a.accepted < stats_a.drafted
    t1, _, _ = sample_run(target, draft, prompt, seed=7, temperature=0.7, top_k=20, top_p=0.9)
    t2, _, _ = sample_run(target, draft, prompt, seed=7, temperature=0.7, top_k=20, top_p=0.9)
    assert t1 == t2


def test_sampling_with_an_identical_draft_accepts_everything(models):
    """p == q (the draft is the target): acceptance min(1, p/q) = 1, so (up to float noise) every token is accepted.
    A misaligned q (off by one position) or different processing of p and q would reject often."""
    target, draft, prompt, _ = models["llama"]
    twin = copy.deepcopy(target)
    # temperature 0.1 makes the near-uniform random model peaked, so that a q unequal to p gets rejected
    _, stats, _ = sample_run(target, twin, prompt, seed=3, k=4, temperature=0.1, top_k=50)
    assert stats.drafted > 20
    assert stats.acceptance_rate > 0.97, stats.acceptance_rate
    _, other, _ = sample_run(target, draft, prompt, seed=3, k=4, temperature=0.1, top_k=50)
    assert other.acceptance_rate < 0.8  # the same setting does tell p from a slightly different q


def test_sampling_with_ngram_drafter_runs_and_is_reproducible(models):
    target, _, _, _ = models["neox"]
    base = make_prompt(4, length=5)[0]
    prompt = torch.cat([base, base, base]).view(1, -1)
    a, stats, _ = speculate(target, NGramDrafter(), prompt, ConstantK(3), do_sample=True, seed=1)
    b, _, _ = speculate(target, NGramDrafter(), prompt, ConstantK(3), do_sample=True, seed=1)
    assert a == b and len(a) == NEW_TOKENS and stats.drafted > 0


# ------------------------------------------------------------------------------------------------------ embedded (slow)
def _real_prompts(tokenizer) -> dict[str, torch.Tensor]:
    import inspect
    import json as json_module

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain in three sentences why the sky is blue."}],
        add_generation_prompt=True, return_tensors="pt")
    chat = chat if torch.is_tensor(chat) else chat["input_ids"]
    license_text = open("/usr/share/common-licenses/Apache-2.0").read()
    passage = license_text[license_text.index("2. Grant of Copyright License"):][:900]
    summarize = tokenizer(f"{passage}\n\nSummarize the paragraph above in one sentence:\n", return_tensors="pt")
    source = inspect.getsource(json_module.dumps).splitlines()[:14]
    code = tokenizer("\n".join(source) + "\n", return_tensors="pt")
    return {"chat": chat, "summarize": summarize.input_ids, "code": code.input_ids}


EMBEDDED_NEW_TOKENS = 32  # test_tree's embedded trees check the same references (conftest's embedded_greedy)


@pytest.fixture(scope="module")
def embedded_cases(embedded_greedy):
    """{name: (prompt ids, HF greedy reference of 32 tokens)} for the three real prompts (decoded once per worker)."""
    return {name: embedded_greedy(name, EMBEDDED_NEW_TOKENS) for name in ("chat", "summarize", "code")}


@pytest.mark.slow
@pytest.mark.heavy  # ~20 s each (the references ~10 s); test_hf_generate checks the embedded model greedy in make test
@pytest.mark.parametrize("drafter_kind", ["self_int4", "ngram"])
def test_embedded_greedy_matches_ar_on_real_prompts(embedded, embedded_int4, embedded_cases, drafter_kind):
    model, _ = embedded
    accepted = 0
    for name, (prompt, reference) in embedded_cases.items():
        drafter = DraftModel(embedded_int4[0]) if drafter_kind == "self_int4" else NGramDrafter()
        ids, stats, _ = speculate(model, drafter, prompt, ConstantK(4), max_new_tokens=EMBEDDED_NEW_TOKENS)
        assert ids == reference, name
        assert stats.rounds >= 2
        if drafter_kind == "self_int4":
            assert stats.accepted > 0, name
            assert stats.acceptance_rate > 0.3, (name, stats.acceptance_rate)
        accepted += stats.accepted
    assert accepted > 0
