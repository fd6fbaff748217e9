"""Shared fixtures: tiny random-weight models built from configs, and the embedded SmolLM2 model (slow)."""

from __future__ import annotations

import os
import tempfile

from toolkit.threads import thread_environment  # noqa: I001 (must run before torch loads OpenMP)

thread_environment()  # idle OpenMP threads sleep: a busy machine does not stall the suite

import pytest  # noqa: E402
import torch  # noqa: E402

# verify cost curves measured by tests go to a throwaway directory, not the user's cache: one per test run, shared by
# its xdist workers (written atomically), so the embedded model's curve is measured once per run, not per worker
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("TOOLKIT_VERIFY_COST_DIR", os.path.join(tempfile.gettempdir(), f"toolkit-verify-cost-{_RUN}")
                      if _RUN else tempfile.mkdtemp(prefix="toolkit-verify-cost-"))
# the CPU engines a developer installed (.venv-engines) stay out of the suite's --compare runs
# the suite's workers load each other's cores: their verify cost curves would all count as measured under load
os.environ.setdefault("TOOLKIT_VERIFY_COST_MAX_LOAD", "1")
os.environ.setdefault("TOOLKIT_ENGINES_PYTHON", "off")
# thousands of short-lived models: no full garbage collection + heap freeze at each build (toolkit.heap)
os.environ.setdefault("TOOLKIT_GC_FREEZE", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core (make test: pytest -n 2): one thread each
    torch.set_num_threads(1)


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 128, max_positions: int = 512, **overrides):
    """A random-weight Llama (GQA: 4 query / 2 KV heads, head_dim 16), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, **overrides)
    return LlamaForCausalLM(config).eval()


def tiny_neox(seed: int = 0, layers: int = 2, vocab: int = 128, max_positions: int = 512, **overrides):
    """A random-weight GPT-NeoX (Pythia layout: partial rotary, rotary_pct 0.25), fp32, eval mode."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, max_position_embeddings=max_positions, rotary_pct=0.25,
                           **overrides)
    return GPTNeoXForCausalLM(config).eval()



def hf_forward(model, **kwargs):
    """``model(**kwargs)`` with the cache under the name the model's forward takes (``cache`` from transformers 5.24
    on, which deprecates ``past_key_values`` and removes it in 5.40; ``past_key_values`` before), as the library
    passes it (:func:`toolkit.engine.forward.model_kwargs`)."""
    from toolkit.engine.forward import model_kwargs

    return model(**model_kwargs(model, kwargs))


def perturbed_copy(model, scale: float = 0.02, seed: int = 1):
    """A copy of ``model`` with Gaussian noise added to every weight: a draft that agrees often but not always."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * scale * param.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct at fp32 on CPU (converted once, then cached)."""
    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec

    return load_model(ModelSpec(source="embedded", precision="fp32", device="cpu"))


@pytest.fixture(scope="session")
def embedded_int4():
    """(model, tokenizer) of the embedded model at int4 (bitsandbytes NF4) on CPU: the ``self`` drafter's weights."""
    import logging

    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec

    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return load_model(ModelSpec(source="embedded", precision="int4", device="cpu"))


@pytest.fixture(scope="session")
def embedded_greedy(embedded):
    """``reference(name, new_tokens)`` -> ``(prompt ids, HF greedy continuation)`` on the embedded model for the real
    prompts of ``test_decoder._real_prompts`` (chat, summarize, code), shared by the modules that check against them
    (test_decoder, test_tree): each prompt is decoded once per worker, to the longest length asked for (EOS
    disabled, so a shorter reference is a prefix of a longer one)."""
    from test_decoder import _real_prompts, hf_greedy

    model, tokenizer = embedded
    prompts = _real_prompts(tokenizer)
    decoded: dict[str, list[int]] = {}

    def reference(name: str, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        if len(decoded.get(name, ())) < new_tokens:
            decoded[name] = hf_greedy(model, prompts[name], new_tokens)
        return prompts[name], decoded[name][:new_tokens]

    return reference


@pytest.fixture(scope="session")
def eagle_pair():
    """``(target, head)``: test_eagle's tiny target and the EAGLE-1 head trained on it (``test_eagle.train_head``),
    built once per worker for the modules that read them (test_eagle, test_eagle_tree)."""
    from test_eagle import INIT, train_head

    target = tiny_llama(seed=0, **INIT)
    return target, train_head(target)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread (many tiny forwards: threading overhead dominates), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


from postgres import postgres_url  # noqa: E402,F401  (a throwaway PostgreSQL server: tests/postgres.py)


def batch_decoder(target, drafter, curve, calibrator=None, num_draft_tokens: int = 8, batch_size: int = 8,
                  policy=None, forward=None):
    """The one decoder (:class:`toolkit.engine.decoder.SpeculativeDecoder`) over ``batch_size`` rows, verifying what
    pays by the cost curve ``curve`` (a :class:`~toolkit.speculative.cost_model.VerifyCost`) with K =
    ``num_draft_tokens``; ``decode_batch(prompts, gen)`` runs it. ``drafter``: a row drafter, or a maker of
    single-sequence drafters (one per row)."""
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.engine.planner import CostAwareK, ForwardCost
    from toolkit.speculative.verify_length import Calibrator

    from toolkit.speculative.drafters import RowDrafter, RowDrafters

    controller = CostAwareK(ForwardCost(curve), calibrator or Calibrator(), num_draft_tokens, num_draft_tokens + 1)
    if drafter is not None and (isinstance(drafter, type) or not isinstance(drafter, RowDrafter)):  # a maker
        drafter = RowDrafters(drafter)
    return SpeculativeDecoder(target, drafter, controller, policy, forward=forward, batch_size=batch_size)
