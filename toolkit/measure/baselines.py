"""Reference decoders from HF transformers, run on the same model objects, prompts and settings as ours.

* ``ar`` — plain autoregressive ``model.generate``.
* ``ar_static`` — the same with HF's static cache and HF's own ``torch.compile`` of the decoding step
  (``cache_implementation="static"`` + ``CompileConfig(dynamic=False)``, forced on every device: HF compiles by
  default on CUDA only): the strongest HF baseline. ``max_cache_len`` fixes the cache's size for every call, so one
  compiled graph serves every prompt (the first call compiles: time it apart).
* ``assisted`` — HF assisted generation (``assistant_model``), constant ``num_assistant_tokens`` = K and no
  confidence-based early stop, so it drafts exactly like our constant-K loop.
* ``prompt_lookup`` — HF prompt lookup decoding (``prompt_lookup_num_tokens`` = K, ``max_matching_ngram_size``).

Each returns the new token ids and a :class:`~toolkit.speculative.stats.GenerationStats` with timings (TTFT from a
streamer callback), target forward counts and tokens per round (new tokens after the first per target forward after
prefill), so the comparison table reads the same for every row.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers.generation.streamers import BaseStreamer

from toolkit.measure.timing import synchronize
from toolkit.recipe import GenerationSpec
from toolkit.speculative.stats import GenerationStats

BASELINES = ("ar", "ar_static", "assisted", "prompt_lookup")


class _FirstTokenTimer(BaseStreamer):
    """Records when ``generate`` emits its first new token (the first ``put`` after the prompt)."""

    def __init__(self, device):
        self.device, self.calls, self.first = device, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            synchronize(self.device)
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_generate(model, input_ids: torch.Tensor, gen: GenerationSpec, eos_token_ids: list[int], *,
                method: str = "ar", assistant_model=None, num_draft_tokens: int = 4, max_ngram: int = 3,
                tokenizer=None, assistant_tokenizer=None, max_cache_len: int | None = None,
                compile_backend: str = "inductor", compile_mode: str | None = None
                ) -> tuple[list[int], GenerationStats]:
    """Run one HF ``generate`` baseline (``method`` in :data:`BASELINES`) and time it.

    ``input_ids`` has shape ``(1, prompt_len)``. EOS handling mirrors ours: ``gen.ignore_eos`` removes the EOS ids
    from the generation config instead of faking one. ``assisted`` with an ``assistant_tokenizer`` (and the target's
    ``tokenizer``) is HF's universal assisted decoding (a draft with another vocabulary). Raises ``ValueError`` for an
    unknown method.
    """
    if method not in BASELINES:
        raise ValueError(f"method: unknown baseline {method!r} (allowed: {', '.join(BASELINES)})")
    device = next(model.parameters()).device
    config = _generation_config(model, gen, eos_token_ids)
    kwargs, restore = {}, None
    if method == "assisted":
        kwargs, restore = _assisted(config, assistant_model, num_draft_tokens, tokenizer, assistant_tokenizer)
    elif method == "ar_static":
        _static_compiled(config, max_cache_len, compile_backend, compile_mode)
    elif method == "prompt_lookup":
        config.prompt_lookup_num_tokens = num_draft_tokens
        config.max_matching_ngram_size = max_ngram
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    timer = _FirstTokenTimer(device)
    input_ids = input_ids.to(device)
    if gen.do_sample:
        torch.manual_seed(gen.seed)
    try:
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                 streamer=timer, **kwargs)
        synchronize(device)
        end = time.perf_counter()
    finally:
        hook.remove()
        if restore is not None:
            restore()
    new_ids = out[0, input_ids.shape[1]:].tolist()
    stats = GenerationStats(prompt_tokens=input_ids.shape[1], new_tokens=len(new_ids))
    stats.target_forwards = forwards[0]
    stats.rounds = max(forwards[0] - 1, 0)
    stats.committed = max(len(new_ids) - 1, 0)
    stats.ttft_ms = ((timer.first or end) - start) * 1000
    stats.total_ms = (end - start) * 1000
    stats.finish_reason = "length" if len(new_ids) >= gen.max_new_tokens else "eos"
    return new_ids, stats


def _generation_config(model, gen: GenerationSpec, eos_token_ids: list[int]):
    """A copy of ``model``'s generation config set to ``gen`` (EOS as ours: ``gen.ignore_eos`` removes the ids)."""
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = gen.max_new_tokens
    config.min_new_tokens = None
    config.do_sample = gen.do_sample
    config.temperature, config.top_k, config.top_p = gen.temperature, gen.top_k or None, gen.top_p
    # [] (not None): transformers replaces a None eos_token_id with the model generation config's own EOS
    config.eos_token_id = [] if gen.ignore_eos or not eos_token_ids else list(eos_token_ids)
    if config.pad_token_id is None:
        config.pad_token_id = eos_token_ids[0] if eos_token_ids else 0
    return config


def _assisted(config, assistant_model, num_draft_tokens: int, tokenizer, assistant_tokenizer):
    """HF assisted generation with a constant ``num_draft_tokens``: ``(generate kwargs, restore)``; HF reads the
    schedule from the assistant's own generation config, so it is set for this call only and ``restore()`` puts the
    assistant's back. Raises ``ValueError`` without an assistant."""
    if assistant_model is None:
        raise ValueError("assistant_model: required for the 'assisted' baseline")
    kwargs = {"assistant_model": assistant_model}
    if assistant_tokenizer is not None:  # universal assisted decoding: HF translates between the tokenizers
        kwargs.update(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    saved = assistant_model.generation_config
    assistant_config = copy.deepcopy(saved)
    for cfg in (config, assistant_config):
        cfg.num_assistant_tokens = num_draft_tokens
        cfg.num_assistant_tokens_schedule = "constant"
        cfg.assistant_confidence_threshold = 0.0
    assistant_model.generation_config = assistant_config

    def restore() -> None:
        assistant_model.generation_config = saved

    return kwargs, restore


def _static_compiled(config, max_cache_len: int | None, backend: str, mode: str | None) -> None:
    """Turn ``config`` into HF's static-cache + compiled decoding step (see ``ar_static`` in the module docstring)."""
    from transformers import CompileConfig

    config.cache_implementation = "static"
    if max_cache_len is not None and hasattr(config, "max_cache_len"):  # a field of recent releases; older ones size per call
        config.max_cache_len = max_cache_len
    config.compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=backend, mode=mode or "default")
    config.compile_config._compile_all_devices = True
