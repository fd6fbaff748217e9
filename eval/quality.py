"""Output quality of a recipe: what its precision and KV policy do to the generated text, against the fp32 AR reference.

Beside perplexity (which scores held-out text), an evaluation scores the recipe's own outputs on the per-request
prompts, through the toolkit's shipped HF ``evaluate`` modules (:mod:`toolkit.metrics`, loaded offline by path):

* summarization prompts (kind ``summarize``): ROUGE-L (Lin 2004; module ``rouge_l``: LCS of words, F1 with
  precision and recall) of the recipe's generated text against the reference text;
* code prompts (kind ``code``): exact match, first divergence (index of the first differing token) and the fraction
  of the reference before it (module ``first_divergence``), on token ids — code is judged by exact tokens;
* summarization prompts whose suite gives a written answer (``reference`` in the suite file, e.g. the long-context
  suites): ROUGE-L of the recipe's text against that answer (``rouge_l_written``), which needs no reference model and,
  unlike agreement with one greedy text, does not fall when two good texts diverge early.

The reference is the fp32 target without KV compression, HF greedy ``generate`` (autoregressive), on the same prompt
with the same ``max_new_tokens`` and EOS setting: the output of the ``ar_fp32`` baseline when it was timed (a target
that is not fp32), of the ``ar`` baseline when the target is itself fp32 (the same model: ``ar`` is then the fp32
AR reference), else generated here once, untimed, on the reference model (cached per process). Texts are the
tokenizer's ``decode(ids, skip_special_tokens=True)``; without a tokenizer (token ids injected by tests) the ids
joined by spaces, so ROUGE-L then runs over token ids as words. Greedy recipes are compared token for token with a
greedy reference; a sampling recipe's text is one sample and so is its reference, drawn with the same settings
(``greedy`` false in the section: agreement is then not expected to be exact).

The section (``metrics.json`` → ``quality``, schema ``eval/metrics.schema.json``): ``reference`` (which run gave the
reference), ``greedy``, ``rouge_l`` (mean F1 / precision / recall over the summarization prompts and per prompt) or
``None`` without such a prompt, ``code`` (exact-match rate, mean matched fraction, per prompt first divergence) or
``None`` without a code prompt, ``rouge_l_written`` (as ``rouge_l``, against the written answers) or ``None``
without one, and ``reason`` when a part could not be measured.
"""

from __future__ import annotations

import dataclasses
import json

#: prompt kinds scored by each module
SUMMARY_KINDS = ("summarize",)
CODE_KINDS = ("code",)
_REFERENCE_IDS: dict[tuple, list[int]] = {}  # untimed fp32 AR outputs, per (model, prompt, generation settings)

REFERENCE_DESCRIPTIONS = {
    "ar_fp32": "fp32 target, no KV compression, HF greedy generate (the ar_fp32 baseline's output)",
    "ar": "the recipe's target (fp32), no KV compression, HF greedy generate (the ar baseline's output)",
    "generated": "fp32 target, no KV compression, HF greedy generate (run untimed for this section)",
}


def clear() -> None:
    """Forget the cached reference outputs (with :func:`eval.evaluate.clear_model_cache`)."""
    _REFERENCE_IDS.clear()


def reference_ids(first: dict, items: list, generator, reference_model, gen,
                  wanted: set[int] | None = None) -> tuple[list | None, str | None]:
    """``(token ids per prompt, method)`` of the fp32 AR reference: a timed baseline's first repetition when one is
    the reference (``ar_fp32``; ``ar`` when the reference model is the target), else generated untimed on
    ``reference_model`` for the prompts ``wanted`` (indices; ``None`` = all; the others get ``None``);
    ``(None, None)`` without a reference model. ``first`` maps methods to ``[(ids, stats)]``."""
    if "ar_fp32" in first:
        return [list(ids) for ids, _ in first["ar_fp32"]], "ar_fp32"
    if "ar" in first and reference_model is generator.target:
        return [list(ids) for ids, _ in first["ar"]], "ar"
    if reference_model is None:
        return None, None
    from toolkit.measure.baselines import hf_generate

    eos = generator.eos_token_ids(gen)
    spec = json.dumps(dataclasses.asdict(gen), sort_keys=True, default=str)
    out = []
    for i, item in enumerate(items):
        if wanted is not None and i not in wanted:
            out.append(None)
            continue
        key = (id(reference_model), tuple(item.input_ids[0].tolist()), spec)
        if key not in _REFERENCE_IDS:
            _REFERENCE_IDS[key] = list(hf_generate(reference_model, item.input_ids, gen, eos, method="ar")[0])
        out.append(_REFERENCE_IDS[key])
    return out, "generated"


def keep_count(prompts: list, count: int | None, kinds) -> int | None:
    """The smallest ``n >= count`` such that :func:`toolkit.measure.harness.spread` ``(prompts, n)`` holds a prompt of
    every kind in ``kinds`` that ``prompts`` has (``count`` itself when ``None`` or nothing to keep)."""
    from toolkit.measure.harness import round_robin

    if count is None or not kinds:
        return count
    order = round_robin(prompts)
    need = {p.kind for p in prompts} & set(kinds)
    for n in range(count, len(order) + 1):
        if need <= {p.kind for p in order[:n]}:
            return n
    return len(order)


def _text(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(str(t) for t in ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


def rouge_l_section(ids: list[str], predictions: list[str], references: list[str], tokenizer) -> dict:
    """ROUGE-L of ``predictions`` against ``references`` (texts, one per prompt id) through the ``rouge_l`` module:
    means over the prompts and per prompt, all in [0, 1]."""
    from toolkit.metrics import load

    module = load("rouge_l")
    mean = module.compute(predictions=predictions, references=references)
    each = module.compute(predictions=predictions, references=references, use_aggregator=False)
    return {"value": mean["rouge_l"], "precision": mean["rouge_l_precision"], "recall": mean["rouge_l_recall"],
            "prompts": [{"id": i, "value": f, "precision": p, "recall": r} for i, f, p, r in
                        zip(ids, each["rouge_l"], each["rouge_l_precision"], each["rouge_l_recall"])],
            "tokenization": ("token ids as words, no tokenizer" if tokenizer is None else
                             "decoded text; rouge_score words: lower-cased [a-z0-9] runs, no stemming"),
            "module": "toolkit.metrics rouge_l"}


def written_section(items: list, summary: list[int], texts: dict[int, str], tokenizer) -> dict | None:
    """ROUGE-L of the summarization prompts' ``texts`` (by item index) against their suites' written answers
    (``items[i].reference``), over the prompts that have one; ``None`` when none has."""
    written = [i for i in summary if getattr(items[i], "reference", None)]
    if not written:
        return None
    return rouge_l_section([items[i].id for i in written], [texts[i] for i in written],
                           [items[i].reference for i in written], tokenizer)


def code_section(ids: list[str], predictions: list[list[int]], references: list[list[int]]) -> dict:
    """Exact match, first divergence and matched fraction of token ids through the ``first_divergence`` module."""
    from toolkit.metrics import load

    module = load("first_divergence")
    mean = module.compute(predictions=predictions, references=references)
    each = module.compute(predictions=predictions, references=references, use_aggregator=False)
    return {"exact_match": mean["exact_match"], "matched_fraction": mean["matched_fraction"],
            "prompts": [{"id": i, "exact_match": bool(e), "first_divergence": d, "matched_fraction": m,
                         "reference_tokens": len(r)} for i, e, d, m, r in
                        zip(ids, each["exact_match"], each["first_divergence"], each["matched_fraction"], references)],
            "module": "toolkit.metrics first_divergence"}


def quality_section(items: list, first: dict, generator, reference_model, gen, ours: str = "ours") -> dict:
    """The ``quality`` section of one evaluation (see the module docstring).

    Args:
        items: the per-request prompts (``.id``, ``.kind``, ``.input_ids`` ``(1, prompt_len)``).
        first: ``{method: [(new token ids, stats) per prompt]}`` of the first timed repetition.
        generator: the recipe's :class:`toolkit.speculative_lm.SpeculativeLM` (target, tokenizer, EOS ids).
        reference_model: the fp32 uncompressed target (the target itself when it is fp32), or ``None``.
        gen: the generation settings every method ran with.
    """
    summary = [i for i, it in enumerate(items) if it.kind in SUMMARY_KINDS]
    code = [i for i, it in enumerate(items) if it.kind in CODE_KINDS]
    mine = [list(ids) for ids, _ in first[ours]]
    tok = generator.tokenizer
    texts = {i: _text(tok, mine[i]) for i in summary}  # decoded once: scored against written answers and the reference
    out = {"reference": None, "greedy": not gen.do_sample, "rouge_l": None, "code": None,
           "rouge_l_written": written_section(items, summary, texts, tok)}
    if not summary and not code:
        out["reason"] = "no summarization or code prompt among the evaluated prompts"
        return out
    refs, method = reference_ids(first, items, generator, reference_model, gen, set(summary + code))
    if refs is None:
        out["reason"] = "no fp32 reference model (the target is not fp32 and the reference is off)"
        return out
    sampled = "" if out["greedy"] else "; sampled with the recipe's sampling settings, like the recipe's own text"
    out["reference"] = {"method": method, "description": REFERENCE_DESCRIPTIONS[method] + sampled}
    if summary:
        out["rouge_l"] = rouge_l_section([items[i].id for i in summary], [texts[i] for i in summary],
                                         [_text(tok, refs[i]) for i in summary], tok)
    if code:
        out["code"] = code_section([items[i].id for i in code], [mine[i] for i in code], [refs[i] for i in code])
    if not summary or not code:
        out["reason"] = f"no {'summarization' if not summary else 'code'} prompt among the evaluated prompts"
    return out
