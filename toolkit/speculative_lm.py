"""The Python API: ``toolkit.build(recipe)`` -> :class:`SpeculativeLM`, whose ``generate`` returns text, ids and stats.

    >>> import toolkit
    >>> gen = toolkit.build(toolkit.Recipe.load("recipes/short.yaml"))
    >>> out = gen.generate([{"role": "user", "content": "Name three prime numbers."}], max_new_tokens=32)
    >>> out.text, out.stats.acceptance_rate, out.stats.tokens_per_round

Chat templates are applied when a list of messages is given; a plain string is tokenized as is. Every request is
checked before any forward (:meth:`SpeculativeLM.check_request`): an empty prompt, a prompt longer than the model's
context, a generation that would run past it under absolute positions, and EOS ids outside the vocabulary are
:class:`~toolkit.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch

from toolkit import requests
from toolkit.engine.capabilities import capabilities
from toolkit.engine.cost import load_or_measure
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward, forward_for
from toolkit.engine.planner import ForwardCost, make_controller, reads_cost
from toolkit.errors import ConfigError
from toolkit.heap import freeze_heap
from toolkit.models import model_vocab_size, weight_bytes, weights_note
from toolkit.models.llamacpp import is_llamacpp
from toolkit.recipe import GenerationSpec, Recipe
from toolkit.session import ModelPool, Plan, load_models, plan
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DrafterContext, RowDrafters, build_drafter
from toolkit.speculative.stats import GenerationResult, GenerationStats
from toolkit.speculative.tree import TreeShape
from toolkit.speculative.verify_length import Calibrator

log = logging.getLogger(__name__)


class SpeculativeLM:
    """A built recipe: its :class:`~toolkit.session.Plan` (policies built once) and the loaded models.

    Attributes:
        recipe, plan: the recipe and its plan.
        target, tokenizer: the target model and its tokenizer.
        draft_model: the draft LM (``None`` for the n-gram drafter and autoregressive decoding).
        draft_tokenizer: the draft's tokenizer when it is not the target's (cross-tokenizer drafting), else ``None``.
        target_policy / draft_policy: the plan's KV policies (``None`` = uncompressed).
        weight_bytes: ``{"target": bytes, "draft": bytes}``.
        weights: ``{"target": words, "draft": words}``: which weights each runs (:func:`toolkit.models.weights_note`:
            ``native (torchao int4 weight-only, group 32, symmetric, from the checkpoint)``, ...; draft ``""`` if none).
    """

    def __init__(self, plan: Plan, target, tokenizer, draft_model=None, draft_tokenizer=None):
        self.plan, self.recipe = plan, plan.recipe
        self.target, self.tokenizer, self.draft_model = target, tokenizer, draft_model
        self.draft_tokenizer = draft_tokenizer  # set only when the draft's vocabulary is not the target's
        self.target_policy, self.draft_policy = plan.target_policy, plan.draft_policy
        self.weight_bytes = {"target": weight_bytes(target),
                             "draft": weight_bytes(draft_model) if draft_model is not None else 0}
        self.weights = {"target": weights_note(target),
                        "draft": weights_note(draft_model) if draft_model is not None else ""}
        # what the recipe can do on these models, once (the plan checked the policies alone): at build time, not at a
        # first round
        self.capabilities = capabilities(plan, target, draft_model, draft_tokenizer)
        if self.capabilities.tree:
            raise ConfigError("spec.tree", self.capabilities.tree, [False])
        log.info("recipe %s: %s", self.recipe.name, self.capabilities.summary())
        self._persistent_drafter = None  # a drafter whose config is `persistent` (memory across requests): ONE
        self._verify_cost = None  # the target's verify cost curve (adaptive: cost), measured or read once
        self._engine = None  # the target's forward (recipe.compile: compiled static engine or eager), at first use
        self._draft_engine = None  # the draft LM's forward, likewise
        self.engine_note = ""  # which path decoding takes, and why (reports, the run log)
        self._forward_cost = None  # what forwards cost, one row or a batch (ForwardCost), learned online
        self.calibrator = Calibrator()  # acceptance calibration (adaptive: cost), learned across calls
        self.draft_acceptance = Calibrator()  # a batch draft network's acceptance by position, across calls

    # -------------------------------------------------------------------------------------------- preparation
    def encode(self, prompt: str | list[dict] | torch.Tensor, field: str = "prompt") -> torch.Tensor:
        """Token ids ``(1, prompt_len)`` of a prompt (:func:`toolkit.requests.encode`)."""
        return requests.encode(self.tokenizer, self.recipe.target.source, prompt, field)

    def check_request(self, input_ids: torch.Tensor, gen: GenerationSpec, field: str = "prompt") -> None:
        """Check one request against the models before any forward (:func:`toolkit.requests.check_request`).

        Raises:
            ConfigError: naming ``field`` (the prompt), ``generation.max_new_tokens`` or
                ``generation.eos_token_id[i]``.
        """
        models = [("target", self.target, self.target_policy)]
        if self.draft_model is not None and self.recipe.spec.config.uses_draft_model:
            models.append(("draft", self.draft_model, self.draft_policy))
        requests.check_request(models, model_vocab_size(self.target), input_ids, gen, field)

    def eos_token_ids(self, gen: GenerationSpec) -> list[int]:
        """EOS ids: the generation spec's, else the model's generation config's, else the tokenizer's."""
        if gen.eos_token_id is not None:
            return list(gen.eos_token_id)
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def _generation_spec(self, overrides: dict) -> GenerationSpec:
        known = {f.name for f in dataclasses.fields(GenerationSpec)}
        for key in overrides:
            if key not in known:
                raise ConfigError(f"generation.{key}", "unknown generation argument", sorted(known))
        gen = dataclasses.replace(self.recipe.generation, **overrides)
        gen.validate("generation")
        return gen

    def _drafter(self, gen: GenerationSpec, batch_size: int = 1):
        """The recipe's drafter for one call of ``batch_size`` rows (``None`` = autoregressive), built through the
        drafter registry: a row drafter for every config. A persistent drafter (memory across requests) is ONE per
        SpeculativeLM, forked per row in batches; a drafter serving one row (``batches`` false) is made per row of a
        batch."""
        config = self.recipe.spec.config
        if not config.speculates:
            return None
        if config.persistent:
            if self._persistent_drafter is None:
                self._persistent_drafter = build_drafter(config, self._context(gen))
            root = self._persistent_drafter
            return root if batch_size == 1 else RowDrafters(root.fork, trees=root.trees)
        drafter = build_drafter(config, self._context(gen))
        if batch_size > 1 and not drafter.batches:
            return RowDrafters(lambda: build_drafter(config, self._context(gen)), trees=drafter.trees)
        return drafter

    def _context(self, gen: GenerationSpec) -> DrafterContext:
        """What a drafter of one call is built from: a draft LM's forward engine (:attr:`draft_engine`, compiled on its
        own facts), an EAGLE head's step compiled where the target's forward is (it reads the target graph's hidden
        states)."""
        return DrafterContext(self.target, self.draft_model, self.draft_policy, do_sample=gen.do_sample,
                              temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, seed=gen.seed,
                              tokenizer=self.tokenizer, draft_tokenizer=self.draft_tokenizer,
                              acceptance=self.draft_acceptance, draft_forward=self.draft_engine,
                              compile=self.engine.compiled, backend=self.engine.backend)

    @property
    def draft_engine(self) -> TargetForward | None:
        """The draft LM's forward (``None`` without one): compiled on its own static cache where the recipe compiles
        (``compile`` on / max, or ``auto`` where compiling pays for the draft's weights) and the draft cache has a
        static form, whether or not the target's forward compiles (:attr:`capabilities`' ``draft_compile``)."""
        if self._draft_engine is None and self.draft_model is not None and self.recipe.spec.config.uses_draft_model:
            backend = self.engine.backend or "inductor"  # a llama.cpp target compiles nothing of its own
            self._draft_engine = TargetForward(self.draft_model, compile=self.capabilities.draft_compile is None,
                                               backend=backend, tuned=self.recipe.compile == "max", name="draft")
        return self._draft_engine

    def forget(self) -> None:
        """Drop what earlier calls taught this SpeculativeLM: the drafter's memory of earlier requests and the
        acceptance calibration (benchmarks call it between repetitions, so no repetition sees another's prompts)."""
        if self._persistent_drafter is not None:
            self._persistent_drafter.close()
        self._persistent_drafter = None
        self.calibrator = Calibrator()
        self.draft_acceptance = Calibrator()

    @property
    def verify_cost(self) -> VerifyCost:
        """The target's verify cost curve on this machine through its forward (:mod:`toolkit.speculative.cost_model`):
        read from the user cache, or measured once (a few seconds) and cached."""
        return self.verify_cost_for(max(16, self.plan.max_query_tokens))

    def verify_cost_for(self, max_tokens: int) -> VerifyCost:
        """The verify cost curve covering forwards of up to ``max_tokens`` tokens (batches: rows x width)."""
        if self._verify_cost is None or self._verify_cost.max_tokens < max_tokens:
            self._verify_cost = load_or_measure(self.target, max_tokens, forward=self.engine)
        return self._verify_cost

    def forward_cost(self, max_tokens: int) -> ForwardCost:
        """What forwards of one row or a batch cost (:class:`~toolkit.engine.planner.ForwardCost`: the curve, and
        batched forwards learned online, kept across calls)."""
        curve = self.verify_cost_for(max_tokens)
        if self._forward_cost is None or self._forward_cost.curve is not curve:
            self._forward_cost = ForwardCost(curve)
        return self._forward_cost

    @property
    def engine(self) -> TargetForward:  # or LlamaCppForward (toolkit.engine.llamacpp_forward), same calls
        """The target's forward (:mod:`toolkit.engine.forward`): compiled on the static cache, or eager, as the
        recipe's ``compile`` and the plan allow; :attr:`engine_note` says which and why. ``engine.warm_up`` compiles
        its graphs ahead of the first request."""
        if self._engine is None and is_llamacpp(self.target):  # the GGUF on llama.cpp (target.backend)
            from toolkit.engine.llamacpp_forward import forward_for as llamacpp_forward_for

            self._engine, self.engine_note = llamacpp_forward_for(self.recipe, self.target, self.plan,
                                                                  self._features())
            log.info("decoding path: %s", self.engine_note)
        if self._engine is None:
            self._engine, self.engine_note = forward_for(self.recipe, self.target, self.plan, self.capabilities)
            log.info("decoding path: %s", self.engine_note)
        return self._engine

    def warm_up(self, tokens: int, batch_size: int = 1) -> float:
        """Compile the engine's graphs for requests of up to ``tokens`` positions (prompt + new tokens) and batches
        of ``batch_size`` rows before the first request (nothing on the eager path); returns the seconds it took
        (seconds from inductor's on-disk cache, minutes cold) and reads or measures the verify cost curve. Without it,
        the first call of a compiled recipe compiles (logged on the ``toolkit.engine`` logger) and reports that time
        as ``stats.compile_ms``, outside its other times. A llama.cpp target runs its widest verify (grows_outputs).

        Raises:
            ConfigError: ``tokens`` or ``batch_size`` not a positive integer (named).
        """
        from toolkit.checks import check_int
        from toolkit.kv.static import capacity_for

        check_int("tokens", tokens, low=1)
        check_int("batch_size", batch_size, low=1)
        engine, draft, spec = self.engine, self.draft_engine, self.recipe.spec
        nets = [(f, p, h) for f, p, h in ((engine, self.target_policy, self._features()), (draft, self.draft_policy,
                ())) if f is not None and (f.compiled or getattr(f, "grows_outputs", False))]
        if not nets:
            return 0.0
        widest = engine.width_for(max(self.plan.verify_room, spec.tree_budget + 1 if spec.tree else 0))
        capacity, rows, seconds = capacity_for(tokens + widest), (1,) if batch_size == 1 else (1, batch_size), 0.0
        for forward, policy, features in nets:  # the target's graphs, and the draft network's on its own cache
            widths = ((widest,) if not forward.compiled else  # llama.cpp: the widest verify grows its logits buffer
                      tuple(w for w in forward.widths if w <= widest) if forward.buckets else (1, 2))
            seconds += forward.warm_up(lambda r, f=forward, p=policy: f.cache_for(p, r, capacity, widest),
                                       widths, rows, features)
        if reads_cost(spec):
            self.verify_cost_for(max(16, self.plan.max_query_tokens))
        freeze_heap()  # and the compiled graphs
        return seconds

    def _features(self) -> tuple[int, ...]:
        """The target's hidden states the recipe's drafter reads (an EAGLE head's feature layers; else none)."""
        from toolkit.eagle.features import hidden_indices
        from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD

        if self.recipe.spec.config.draft != DRAFT_EAGLE_HEAD or self.draft_model is None:
            return ()
        return hidden_indices(self.target, self.draft_model.config.feature_layers)

    def decoder(self, gen: GenerationSpec, batch_size: int = 1) -> SpeculativeDecoder:
        """A fresh decode loop for one call of ``batch_size`` rows per forward (the drafter is per call unless its
        config is persistent; the cost curve and the acceptance calibration are per SpeculativeLM)."""
        spec = self.recipe.spec
        tree = TreeShape(spec.tree_budget, spec.tree_depth, spec.tree_topk) if spec.tree else None
        k = spec.num_draft_tokens if spec.config.speculates else 0
        cost = self.forward_cost(max(16, self.plan.max_query_tokens, batch_size * (k + 1))) \
            if reads_cost(spec) else None
        controller = make_controller(spec, cost, self.calibrator, self.plan.verify_room)
        drafter = self._drafter(gen, batch_size)
        return SpeculativeDecoder(self.target, drafter, controller, self.target_policy, tree, self.engine,
                                  batch_size)

    # -------------------------------------------------------------------------------------------- generation
    def _stop_check(self, gen: GenerationSpec):
        if not gen.stop_strings:
            return None
        tokenizer, stops = self.tokenizer, gen.stop_strings

        def should_stop(new_ids: list[int]) -> int | None:
            text = tokenizer.decode(new_ids, skip_special_tokens=True)
            if not any(s in text for s in stops):
                return None
            for cut in range(1, len(new_ids) + 1):  # shortest prefix whose text holds a stop string
                if any(s in tokenizer.decode(new_ids[:cut], skip_special_tokens=True) for s in stops):
                    return cut
            return None

        return should_stop

    def _run(self, prompt, overrides, stats: GenerationStats | None = None,
             ) -> tuple[Iterator[list[int]], GenerationStats, list[int], GenerationSpec]:
        gen = self._generation_spec(overrides)
        input_ids = self.encode(prompt)
        self.check_request(input_ids, gen)
        stats = stats if stats is not None else GenerationStats()
        compiled = self.engine.compile_ms
        decoder = self.decoder(gen)
        stats.compile_ms += self.engine.compile_ms - compiled  # the verify cost curve, measured through new graphs
        chunks = decoder.decode(input_ids, gen, stats, self.eos_token_ids(gen), self._stop_check(gen))
        return chunks, stats, input_ids[0].tolist(), gen

    def _text(self, ids: list[int], gen: GenerationSpec) -> str:
        if self.tokenizer is None:  # built without a tokenizer (token-id prompts): ids only
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in gen.stop_strings:  # end right after the first stop string
            at = text.find(stop)
            if at >= 0:
                text = text[: at + len(stop)]
        return text

    def generate(self, prompt: str | list[dict], **overrides) -> GenerationResult:
        """Generate a completion of ``prompt`` (a string or chat messages); a list of prompts is
        :meth:`generate_batch` (returns a list of results in input order).

        ``overrides`` replace fields of the recipe's generation section for this call (``max_new_tokens``,
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``ignore_eos``, ``eos_token_id``, ``stop_strings``,
        ``seed``). Raises :class:`ConfigError` for an unknown or invalid argument.
        """
        if _is_prompt_list(prompt):
            return self.generate_batch(prompt, **overrides)
        chunks, stats, prompt_ids, gen = self._run(prompt, overrides)
        new_ids = [tok for chunk in chunks for tok in chunk]
        return GenerationResult(self._text(new_ids, gen), new_ids, prompt_ids, stats)

    def generate_stream(self, prompt: str | list[dict], stats: GenerationStats | None = None,
                        **overrides) -> Iterator[str]:
        """Yield the completion's text incrementally, as tokens commit (same arguments as :meth:`generate`); pass a
        :class:`~toolkit.speculative.stats.GenerationStats` as ``stats`` to read the round statistics afterwards."""
        chunks, _, _, gen = self._run(prompt, overrides, stats)
        ids: list[int] = []
        emitted = ""
        for chunk in chunks:
            ids.extend(chunk)
            text = self._text(ids, gen)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
                continue
            if len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
        text = self._text(ids, gen)
        if len(text) > len(emitted):
            yield text[len(emitted):]

    # -------------------------------------------------------------------------------------------- batches
    @property
    def batchable(self) -> bool:
        """The recipe runs as batched speculative decoding (:attr:`capabilities`' ``batch``): a drafter whose config
        allows batches (model-free, an EAGLE head, a draft model sharing the target's vocabulary) or AR, on caches the
        static engine holds (every KV policy has a static form; on models with sliding-window layers only the
        uncompressed cache: :func:`toolkit.kv.rows.static_why`), not llama.cpp's; chains (no token trees)."""
        return self.capabilities.batch is None

    def generate_batch(self, prompts: list, batch_size: int | None = None, **overrides) -> list[GenerationResult]:
        """Generate a completion of every prompt, ``batch_size`` of them per target forward (continuous batching:
        a finished row's place goes to the next prompt); results in input order. ``batch_size`` ``None``: the
        recipe's (:attr:`toolkit.recipe.Recipe.rows_per_forward`).

        Batched decoding (the one decoder, :mod:`toolkit.engine.decoder`, over ``batch_size`` rows) needs
        :attr:`batchable`; any other recipe runs the prompts one at a time (logged). Raises ConfigError for a bad
        ``batch_size`` or generation argument.
        """
        from toolkit.checks import check_int
        from toolkit.recipe import BATCH_SIZE_MAX

        batch_size = self.recipe.rows_per_forward if batch_size is None else batch_size
        check_int("batch_size", batch_size, low=1, high=BATCH_SIZE_MAX)
        if not self.batchable or batch_size == 1:
            if batch_size > 1:
                log.info("recipe %s runs its prompts one at a time: %s", self.recipe.name, self.capabilities.batch)
            return [self.generate(p, **overrides) for p in prompts]
        gen = self._generation_spec(overrides)
        inputs = [self.encode(p) for p in prompts]
        for i, input_ids in enumerate(inputs):
            self.check_request(input_ids, gen, f"prompts[{i}]")
        compiled = self.engine.compile_ms
        decoder = self.decoder(gen, batch_size)
        measured = self.engine.compile_ms - compiled  # the verify cost curve, measured through new graphs
        rows = decoder.decode_batch(inputs, gen, self.eos_token_ids(gen), self._stop_check(gen))
        for _, stats in rows:
            stats.compile_ms += measured
        return [GenerationResult(self._text(ids, gen), ids, x[0].tolist(), stats)
                for (ids, stats), x in zip(rows, inputs)]


def _is_prompt_list(prompt) -> bool:
    """A list of prompts (strings or message lists), as opposed to one chat (a list of message dicts)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) or torch.is_tensor(p)
                                                             for p in prompt)


def build(recipe: Recipe, target=None, tokenizer=None, draft_model=None, pool: ModelPool | None = None,
          draft_tokenizer=None) -> SpeculativeLM:
    """Plan ``recipe`` (:func:`toolkit.session.plan`), load its models and return a :class:`SpeculativeLM`; then
    freeze the live heap out of full garbage collections (:func:`toolkit.heap.freeze_heap`).

    Models come from ``pool`` (a :class:`~toolkit.session.ModelPool`, so several recipes share them) or a fresh
    one; already-loaded ``target``/``tokenizer``/``draft_model`` (and the draft's ``draft_tokenizer`` when it is
    not the target's) may be passed instead. A ``draft_model`` drafter whose tokenizer is not the target's drafts
    across tokenizers (:mod:`toolkit.speculative.drafters.cross_tokenizer`).

    Raises:
        ConfigError: invalid recipe field or combination (named).
        ModelLoadError: a model source cannot be read.
        TokenizerMismatchError: target and draft vocabularies differ where the drafter cannot translate.
    """
    p = plan(recipe)
    target, tokenizer, draft_model, draft_tokenizer = load_models(p, pool, target, tokenizer, draft_model,
                                                                  draft_tokenizer)
    lm = SpeculativeLM(p, target, tokenizer, draft_model, draft_tokenizer)
    if is_llamacpp(target):
        lm.engine  # noqa: B018 - llama.cpp's model and context load here (~0.3 s), not inside the first request
    freeze_heap()  # full garbage collections skip the models from here on (toolkit.heap)
    return lm


__all__ = ["SpeculativeLM", "build"]
