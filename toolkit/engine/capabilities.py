"""What a built recipe can do on its loaded models, decided once and read everywhere.

Whether the target's cache is the static engine's, whether the target's and the draft network's forwards compile,
whether requests share a batch and whether token trees run all follow from the same few facts: the KV policies'
static forms and the models' layers (:func:`toolkit.kv.rows.static_why`), the target's backend (llama.cpp), its
weights and device (:func:`toolkit.engine.forward.compile_pays`), and the recipe's ``compile`` and ``spec``.
:func:`capabilities` works them out once, when :func:`toolkit.build` has the models; the forward choice
(:func:`toolkit.engine.forward.forward_for`), batching (:attr:`toolkit.speculative_lm.SpeculativeLM.batchable`),
the draft network's engine and the tree check read the record, and the run log prints it
(:meth:`Capabilities.summary`). Each answer is ``None`` where the recipe can, else the reason it cannot, in words the
run log and errors quote.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """Why a recipe cannot do each thing on its models (``None``: it can).

    Attributes:
        static: the target's cache is not the static engine's (the decoder then holds one sequence, eager).
        draft_static: a draft LM's cache is not (``None`` also without a draft LM).
        compile: the target's forward runs eager (``compile: off``, weights where compiling does not pay, a cache the
            static engine does not hold, a tree wider than the widest CUDA graph).
        draft_compile: the draft LM's forward runs eager (``None`` also without a draft LM).
        batch: requests cannot share a forward (:meth:`~toolkit.speculative_lm.SpeculativeLM.generate_batch` then
            decodes them one at a time).
        tree: token trees cannot run (``None`` also where the recipe asks for chains); building refuses the recipe.
        draft: a draft LM runs beside the target (the summary then says whether it compiles).
    """

    static: str | None = None
    draft_static: str | None = None
    compile: str | None = None
    draft_compile: str | None = None
    batch: str | None = None
    tree: str | None = None
    draft: bool = False

    def draft_note(self) -> str:
        """What the run log's path line adds for a draft LM (``""`` without one): compiled, or eager and why."""
        if not self.draft:
            return ""
        return "; draft LM " + ("compiled on its own static cache" if self.draft_compile is None else
                                f"eager ({self.draft_compile})")

    def summary(self) -> str:
        """One line for the run log: what runs where, and why not where it does not."""
        def say(what: str, why: str | None) -> str:
            return f"{what}: {'yes' if why is None else 'no (' + why + ')'}"

        parts = [say("static engine", self.static), say("compiled", self.compile), say("batches", self.batch)]
        if self.draft:
            parts.append(say("draft compiled", self.draft_compile))
        if self.tree is not None:
            parts.append(say("token trees", self.tree))
        return "; ".join(parts)


def capabilities(plan, target, draft_model=None, draft_tokenizer=None) -> Capabilities:
    """The :class:`Capabilities` of ``plan``'s recipe on its loaded ``target`` and ``draft_model`` (``draft_tokenizer``
    given only when the draft's vocabulary is not the target's: cross-tokenizer drafts)."""
    from toolkit.kv.rows import static_why
    from toolkit.models.llamacpp import is_llamacpp

    recipe, spec = plan.recipe, plan.recipe.spec
    llamacpp = is_llamacpp(target)
    static = "a llama.cpp target, which keeps llama.cpp's own KV cache" if llamacpp else \
        static_why(plan.target_policy, target)
    drafts = draft_model is not None and spec.config.uses_draft_model
    draft_static = static_why(plan.draft_policy, draft_model) if drafts else None
    compile_why = "the target runs on llama.cpp's kernels" if llamacpp else _compile_why(recipe, target, static)
    draft_compile = _draft_compile_why(recipe, draft_model, draft_static) if drafts else None
    return Capabilities(static=static, draft_static=draft_static, compile=compile_why, draft_compile=draft_compile,
                        batch=_batch_why(spec, static, draft_static, drafts and draft_tokenizer is not None),
                        tree=_tree_why(spec, static, draft_static, drafts), draft=drafts)


def compile_breaks(model) -> str | None:
    """Why compiling ``model``'s forward would change its output, or ``None``: torchao's int8 weights with dynamic
    int8 activations (``Int8Tensor`` with ``act_quant_kwargs``: ``torchao_int8: dynamic``, the default of
    ``precision: int8`` on CPU) on CPU. Inductor's CPU lowering of their per-token activation quantization and int8
    matmuls (torch 2.13, torchao 0.18) drifts from eager layer by layer: one layer is exact, the embedded model's
    last hidden state is 0.03 off after two layers and 1.8 (of 34) after 30, and its greedy text breaks down from the
    second token, while ``aot_eager`` (the same traced graph without inductor) is exact and weight-only int8 compiles
    exactly; HF's static-cache compiled AR on the same weights diverges the same way. Such weights run eager
    (``compile`` on or auto), and ``--compare`` leaves out HF's compiled AR baseline for them."""
    for p in model.parameters():
        data = p.data
        if p.device.type == "cpu" and type(data).__name__ == "Int8Tensor" and \
                type(data).__module__.startswith("torchao") and getattr(data, "act_quant_kwargs", None) is not None:
            return ("torchao int8 weights with dynamic int8 activations on CPU: inductor's lowering drifts from eager "
                    "(the embedded model's greedy text breaks down from its second token), so they run eager")
    return None


def _compile_why(recipe, target, static: str | None) -> str | None:
    from toolkit.engine.forward import CUDA_WIDTHS, bucketed, compile_pays
    from toolkit.models.loading import weights_note

    mode = recipe.compile
    if mode == "off":
        return "compile: off"
    if breaks := compile_breaks(target):
        return f"compile: {mode}, but {breaks}"
    if mode == "auto" and not compile_pays(target):
        return (f"compile: auto; {weights_note(target)} weights run bitsandbytes' kernels on CPU, opaque to "
                "torch.compile: compiling gains nothing there")
    if static:
        return f"compile: {mode}, but the static cache does not hold {static}"
    device = next(target.parameters()).device
    if bucketed(device) and recipe.spec.tree and recipe.spec.tree_budget + 1 > CUDA_WIDTHS[-1]:
        return (f"compile: {mode}, but a tree of {recipe.spec.tree_budget} nodes is verified past the widest CUDA "
                f"graph bucket, {CUDA_WIDTHS[-1]} tokens")
    return None


def _draft_compile_why(recipe, draft_model, draft_static: str | None) -> str | None:
    """Why the draft LM's forward runs eager: decided on the draft's own weights and cache, not the target's (an fp32
    target, where compiling gains nothing on CPU, with an int4 draft compiles the draft alone)."""
    from toolkit.engine.forward import compile_pays

    if recipe.compile == "off":
        return "compile: off"
    if breaks := compile_breaks(draft_model):
        return f"the draft's {breaks}"
    if draft_static:
        return f"the static cache does not hold the draft's {draft_static}"
    if recipe.compile == "auto" and not compile_pays(draft_model):
        return "compile: auto; the draft's weights gain nothing from compiling"
    return None


def _batch_why(spec, static: str | None, draft_static: str | None, cross_tokenizer: bool) -> str | None:
    if not spec.config.batch:
        return f"the {spec.drafter} drafter drafts one request at a time"
    if spec.tree:
        return "token trees decode one sequence at a time"
    if static:
        return f"the static cache does not hold {static}"
    if cross_tokenizer:
        return "drafts across tokenizers are re-encoded per request"
    if draft_static:
        return f"the static cache does not hold the draft's {draft_static}"
    return None


def _tree_why(spec, static: str | None, draft_static: str | None, drafts: bool) -> str | None:
    if not spec.tree:
        return None
    for owner, why in (("target", static), ("draft", draft_static if drafts else None)):
        if why:
            return tree_refusal(owner, why)
    return None


def tree_refusal(owner: str, why: str) -> str:
    """The ``spec.tree`` error where the static cache does not hold the ``owner``'s (``target`` or ``draft``) cache,
    ``why`` saying what it is."""
    return (f"token trees run on the static cache, which does not hold the {owner}'s {why}; decode chains "
            "(spec.tree: false) or pick a KV policy with a static form")
