"""``model.generate(..., custom_generate=toolkit.hf.speculative(...))``: this toolkit's decoder inside HF ``generate``.

transformers accepts a callable as ``custom_generate``: ``generate`` runs its usual input preparation, then calls the
callable for the decoding loop (no ``trust_remote_code``; HF docs, "Generation strategies" → "Reusing generate's
preparation steps by passing a callable"; ``GenerationMixin.generate`` in ``transformers/generation/utils.py``).
:func:`speculative` returns such a callable. It builds a :class:`~toolkit.recipe.Recipe` from its arguments (the
drafter registry's names and fields, the adaptive verify length, the KV policies), runs the recipe on the caller's
own model through :func:`toolkit.build` (the :class:`~toolkit.speculative_lm.SpeculativeLM`: its decoder, drafters, cost
model, checks and batched decoding) and returns what HF's own ``generate`` returns.

What a model learns across calls (the verify cost curve, the acceptance calibration, a persistent drafter's memory of
earlier requests, batched forward costs) is kept per model object and recipe in a weak mapping, so repeated calls
neither rebuild nor remeasure, and a model that is dropped is freed with all of it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import weakref

import torch

from toolkit.errors import ConfigError
from toolkit.hf.request import Request, read_request, refuse
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD, DRAFT_UNUSED
from toolkit.speculative.stats import GenerationStats

#: the SpeculativeLM attributes that hold what was learned or measured across calls (restored on every call)
_LEARNED = ("calibrator", "_verify_cost", "_forward_cost", "_persistent_drafter")
#: model -> {recipe key: {attribute: value}}; none of the values refers to the model, so the entry dies with it
_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TARGET_LABEL = "model passed to generate"
_DRAFT_LABEL = "draft_model passed to toolkit.hf.speculative"


def _generate_code():
    from transformers.generation.utils import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__


class SpeculativeGenerate:
    """The callable to pass as ``model.generate(..., custom_generate=...)``; made by :func:`speculative`.

    In ``generate``: ``max_new_tokens`` / ``max_length``, ``eos_token_id`` (an id or a list; the EOS token is kept),
    ``pad_token_id`` (pads rows that stopped early), ``do_sample`` with ``temperature`` / ``top_k`` / ``top_p`` (read
    from the warpers HF builds, including HF's sampling default ``top_k=50``; sampled exactly from the target's
    processed distribution with lossless speculative sampling, seeded from torch's global generator, so
    ``torch.manual_seed`` makes a call reproducible), ``return_dict_in_generate`` (``sequences`` only),
    ``num_return_sequences`` (sampling), a ``streamer`` (batch 1: ``put`` once per round with that round's tokens,
    then ``end``). A batch ``(batch, prompt_len)`` with a left-padded ``attention_mask`` runs as batched speculative
    decoding (:meth:`toolkit.speculative_lm.SpeculativeLM.generate_batch`) where the recipe batches, else row by row;
    each row equals its prompt decoded alone, and the output is laid out as HF's (finished rows padded with ``pad_token_id``).
    ``synced_gpus`` is ignored (one process decodes).

    Refused with one :class:`~toolkit.errors.ConfigError` naming the field (:func:`toolkit.hf.request.read_request`),
    for everything that would change the output and is not supported: ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_length`` / ``min_new_tokens``, ``num_beams`` > 1,
    ``penalty_alpha``, ``dola_layers``, ``min_p`` / ``typical_p`` / ``top_h`` / ``epsilon_cutoff`` / ``eta_cutoff``
    (sampling), ``stop_strings``, ``max_time``, ``output_scores`` / ``output_logits`` / ``output_attentions`` /
    ``output_hidden_states``, other logits processors or stopping criteria, a filled ``past_key_values``,
    ``inputs_embeds`` or other model inputs, right padding, a streamer with a batch, HF's quantized cache; and, as
    the toolkit does everywhere, a prompt plus ``max_new_tokens`` past the model's context
    (``generation.max_new_tokens``) or EOS ids outside the vocabulary.

    Attributes:
        recipe: the recipe it runs (its ``target`` / ``draft`` sections only label the models it is given).
        draft_model: the draft LM or EAGLE head for drafters that need one, else ``None``.
        last_stats: the :class:`~toolkit.speculative.stats.GenerationStats` of every row of the last call
            (acceptance rate α, tokens per round τ, ms per round; the time HF spends preparing is not in them).
    """

    def __init__(self, recipe: Recipe, draft_model=None):
        self.recipe, self.draft_model = recipe, draft_model
        self.last_stats: list[GenerationStats] = []
        self._key = (recipe.config_hash(), id(draft_model))

    def __repr__(self) -> str:
        return f"toolkit.hf.speculative({self.recipe.spec!r}, kv={self.recipe.kv.to_dict()!r})"

    def __call__(self, model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs):
        """Decode after ``input_ids`` ``(batch, prompt_len)`` with the arguments HF prepared.

        ``streamer``: transformers 5.24 does not pass it (:func:`_streamer_of_generate`); it is taken from
        ``generate``'s own arguments.

        Returns:
            ``(batch, prompt_len + new)`` long tensor, or a ``GenerateDecoderOnlyOutput`` (``sequences`` only) when
            ``return_dict_in_generate`` is set.

        Raises:
            ConfigError: naming the field (the class docstring lists what is refused).
        """
        if generation_config is None:
            raise refuse("generation_config", None, "call the model's generate(..., custom_generate=...), which "
                         "prepares it")
        request = read_request(input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
        streamer = streamer if streamer is not None else _streamer_of_generate()
        if streamer is not None and len(request.prompts) > 1:
            raise refuse("streamer", type(streamer).__name__, "streaming needs a batch of one row (as HF's "
                         "streamers do)")
        generator = self._generator(model)
        try:
            rows = self._decode(generator, request, streamer)
        finally:  # keep what this call learned, also when it failed half-way
            _STATE.setdefault(model, {})[self._key] = {name: getattr(generator, name) for name in _LEARNED}
        self.last_stats = [stats for _, stats in rows]
        sequences = _sequences(input_ids, [ids for ids, _ in rows], request.pad_token_id)
        if streamer is not None:
            streamer.end()
        if request.return_dict:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _generator(self, model):
        """The recipe built on ``model`` (cheap: nothing loads), with what earlier calls learned restored."""
        from toolkit.speculative_lm import build

        generator = build(self.recipe, target=model, draft_model=self.draft_model)
        for name, value in _STATE.get(model, {}).get(self._key, {}).items():
            setattr(generator, name, value)
        return generator

    @staticmethod
    def _decode(generator, request: Request, streamer) -> list[tuple[list[int], GenerationStats]]:
        """``(new ids, stats)`` per row: one row through the single-sequence decoder (streamed), several through
        batched decoding when the recipe batches, else one at a time (row i sampled with seed + i, as batches do)."""
        spec = request.spec
        if len(request.prompts) == 1:
            return [_decode_one(generator, request.prompts[0], spec, streamer)]
        batch_size = min(len(request.prompts), generator.recipe.rows_per_forward)
        if generator.batchable and batch_size > 1:
            results = generator.generate_batch(request.prompts, batch_size=batch_size, **dataclasses.asdict(spec))
            return [(result.token_ids, result.stats) for result in results]
        return [_decode_one(generator, ids, dataclasses.replace(spec, seed=spec.seed + i), None, f"input_ids[{i}]")
                for i, ids in enumerate(request.prompts)]


def _decode_one(generator, input_ids: torch.Tensor, spec: GenerationSpec, streamer,
                field: str = "input_ids") -> tuple[list[int], GenerationStats]:
    """One prompt ``(1, prompt_len)`` through :meth:`SpeculativeLM.decoder`; every round's tokens go to ``streamer``."""
    generator.check_request(input_ids, spec, field)
    stats = GenerationStats()
    new_ids: list[int] = []
    for chunk in generator.decoder(spec).decode(input_ids, spec, stats, generator.eos_token_ids(spec)):
        new_ids.extend(chunk)
        if streamer is not None and chunk:
            streamer.put(torch.tensor(chunk, dtype=torch.long))
    return new_ids, stats


def _sequences(input_ids: torch.Tensor, rows: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """HF's output layout: ``input_ids`` (with its padding) followed by each row's new ids, rows that stopped early
    padded with ``pad_token_id`` to the longest row; ``(batch, prompt_len + longest)`` on ``input_ids``' device."""
    longest = max(len(ids) for ids in rows)
    new = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    for i, ids in enumerate(rows):
        new[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return torch.cat([input_ids, new.to(input_ids.device, input_ids.dtype)], dim=1)


def _streamer_of_generate():
    """The ``streamer`` given to ``generate``, read from its frame: transformers 5.24 puts the prompt into it but hands
    a callable ``custom_generate`` no ``streamer`` (``_extract_generation_mode_kwargs`` replaces the mode arguments
    with the callable's own extra keywords). ``None`` when not called from ``generate`` or given none."""
    code = _generate_code()
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


def _kv_spec(value, field: str) -> KVSpec:
    if value is None:
        return KVSpec()
    if isinstance(value, KVSpec):
        return value
    if isinstance(value, str):
        return KVSpec(policy=value)
    if isinstance(value, dict):
        return KVSpec.from_dict(value, field)
    raise ConfigError(field, f"must be None, a policy name, a mapping {{'policy': ..., field: value}} or a KVSpec, "
                      f"got {type(value).__name__}")


def speculative(drafter: str = "lookup", *, num_draft_tokens: int = 16, adaptive: str | None = None, kv=None,
                draft_kv=None, draft_model=None, batch_size: int | None = None, compile: str = "off",
                **options) -> SpeculativeGenerate:
    """A ``custom_generate`` callable that decodes with this toolkit on the caller's own model::

        out = model.generate(**inputs, max_new_tokens=64, custom_generate=toolkit.hf.speculative("lookup"))

    Args:
        drafter: a registered drafter (``lookup``, ``ngram``, ``suffix``, ``draft_model``, ``self``, ``eagle``,
            ``none`` = autoregressive; :mod:`toolkit.speculative.drafters`).
        num_draft_tokens: draft length K in tokens (``adaptive="cost"``: the most asked of the drafter per round).
        adaptive: ``"cost"`` (each round verifies what pays by the model's verify cost curve, measured once per model
            × weight format × device × threads, a few seconds, cached on disk), ``"constant"`` or ``"ema"``;
            ``None``: ``"cost"`` for a drafter that speculates, ``"constant"`` for ``none``.
        kv / draft_kv: KV-cache policy of the target / draft cache: ``None``, a policy name or a mapping
            ``{"policy": "streaming", "sink_tokens": 4, "window": 252}`` (:func:`toolkit.kv.make_policy`).
        draft_model: the loaded draft for drafters that need one: a causal LM with the target's vocabulary
            (``draft_model``; ``self``: the target's own weights at another precision) or an EAGLE head
            (``eagle``: :func:`toolkit.eagle.checkpoint.load_head`).
        batch_size: rows per target forward for a batch of prompts (``None``: 8).
        compile: ``off``, ``on`` or ``auto``: single sequences on the compiled static engine
            (:mod:`toolkit.engine.forward`; the first call compiles, about a minute per width bucket on CPU).
        options: the drafter's own fields and the loop's (``max_ngram``, ``max_match``, ``max_cached_requests``,
            ``tree``, ``k_min``, ...), as in a recipe's ``spec`` section.

    What ``generate`` honours and what it refuses: :class:`SpeculativeGenerate`.

    Raises:
        ConfigError: an unknown drafter or option, an invalid KV policy or combination (the recipe's checks), a
            ``draft_model`` missing for a drafter that needs one or given to one that does not.
    """
    spec = SpeculationSpec(drafter=drafter, num_draft_tokens=num_draft_tokens, adaptive=adaptive or "cost", **options)
    spec.validate("spec")
    if adaptive is None and not spec.config.speculates:
        spec.adaptive = "constant"  # autoregressive: no verify length to choose, no cost curve to measure
    needs = spec.config.draft
    if needs != DRAFT_UNUSED and draft_model is None:
        what = "an EAGLE head (toolkit.eagle.checkpoint.load_head)" if needs == DRAFT_EAGLE_HEAD else \
            "a loaded causal LM with the target's vocabulary"
        raise ConfigError("draft_model", f"drafter {drafter!r} drafts with a model: pass draft_model=<{what}>")
    if needs == DRAFT_UNUSED and draft_model is not None:
        raise ConfigError("draft_model", f"drafter {drafter!r} uses no draft model; leave draft_model=None")
    draft = None if needs == DRAFT_UNUSED else ModelSpec(source=_DRAFT_LABEL)
    recipe = Recipe(name="hf-generate", target=ModelSpec(source=_TARGET_LABEL), draft=draft,
                    kv=_kv_spec(kv, "kv"), draft_kv=_kv_spec(draft_kv, "draft_kv"), spec=spec, batch_size=batch_size,
                    compile=compile)
    from toolkit.session import plan

    plan(recipe)  # every cross-section check (a KV window holding a verify forward, ...) before generate
    return SpeculativeGenerate(recipe, draft_model)
