"""Typed results of an evaluation: what the search, the scenarios and the command line read.

:func:`eval.evaluate.evaluate` returns an :class:`EvalResult`. Its ``to_dict()`` is the document written to
``metrics.json`` (the on-disk contract, ``eval/metrics.schema.json``); the attributes are the quantities code
reads, named and typed once here instead of literal keys scattered over the callers. Units: tokens/s, ms, bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.measure.timing import Summary

MB = 2**20


def _summary(data: dict) -> Summary:
    return Summary(data["median"], data["min"], data["max"], list(data.get("values", [])))


@dataclass(frozen=True)
class EvalResult:
    """One recipe's evaluation.

    Attributes:
        name / config_hash / target_precision: which recipe.
        throughput / ttft_ms / tpot_ms: our decoder's speed, median [min-max] over repetitions; a recipe that sets
            ``batch_size`` is scored as it runs, so ``throughput`` is then its batched throughput over the batch
            prompts (``document["batch"]``) and ``single_throughput`` the per-request stage's.
        ppl: perplexity of held-out text through the recipe's cache; ``ppl_ratio``: over the fp32 uncompressed
            reference (``None`` without one).
        acceptance_rate / tokens_per_round: α and τ over the prompts.
        weight_bytes / kv_peak_bytes / total_peak_bytes: weights (target + draft), peak KV (target + draft, or the
            batch cache's when larger), both.
        ratios: throughput ratios measured in the same run (``ours_vs_ar``, ``ours_vs_assisted``, ...; batched:
            ``ours_batch_vs_hf_batch_ar``, ``ours_batch_vs_ours_single``).
        baseline_throughput: median tok/s of every baseline that ran (``ar``, ``ar_fp32``, ``assisted``, ...,
            ``hf-batch-ar``, ``ours-single``).
        fidelity_vs_ar / fidelity_vs_fp32: match rate of our greedy text against AR (``None`` when not measured).
        rouge_l: mean ROUGE-L F1 (in [0, 1]) of our text against the fp32 AR reference text on the summarization
            prompts; code_exact_match: fraction of code prompts whose tokens equal the reference's; ``None`` when not
            measured (no such prompt, no reference; ``document["quality"]``, :mod:`eval.quality`).
        skipped: loaded from an earlier run instead of measured.
        document: the full ``metrics.json`` document.
    """

    name: str
    config_hash: str
    target_precision: str
    throughput: Summary
    single_throughput: Summary
    ttft_ms: Summary
    tpot_ms: Summary
    ppl: float
    ppl_ratio: float | None
    acceptance_rate: float
    tokens_per_round: float
    weight_bytes: int
    kv_peak_bytes: int
    total_peak_bytes: int
    ratios: dict[str, float]
    baseline_throughput: dict[str, float]
    fidelity_vs_ar: float | None
    fidelity_vs_fp32: float | None
    rouge_l: float | None
    code_exact_match: float | None
    elapsed_s: float
    skipped: bool
    document: dict = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, m: dict) -> EvalResult:
        """Read a ``metrics.json`` document (raises ``KeyError`` for a document of another schema)."""
        ours = m["methods"]["ours"]
        kv = m["memory"]["kv_bytes"]
        fid = m["fidelity"]
        batch = m.get("batch")
        quality = m.get("quality") or {}  # absent from documents written before the quality section existed
        baselines = {k: v["throughput"]["median"] for k, v in m["methods"].items() if k != "ours"}
        ratios = dict(m["ratios"])
        if batch is not None:
            baselines.update({k: v["throughput"]["median"] for k, v in batch["methods"].items() if k != "ours-batch"})
            ratios.update(batch["ratios"])
        return cls(
            name=m["recipe"]["name"], config_hash=m["recipe"]["config_hash"],
            target_precision=m["recipe"]["config"]["target"]["precision"],
            throughput=_summary((batch["methods"]["ours-batch"] if batch else ours)["throughput"]),
            single_throughput=_summary(ours["throughput"]), ttft_ms=_summary(ours["ttft_ms"]),
            tpot_ms=_summary(ours["tpot_ms"]),
            ppl=m["perplexity"]["configured"]["value"], ppl_ratio=m["perplexity"]["ratio_to_fp32"],
            acceptance_rate=m["acceptance"]["acceptance_rate"], tokens_per_round=m["acceptance"]["tokens_per_round"],
            weight_bytes=m["memory"]["weight_bytes"]["total"],
            kv_peak_bytes=max(kv["target_peak"] + kv["draft_peak"], kv.get("batch_peak", 0)),
            total_peak_bytes=m["memory"]["total_peak_bytes"], ratios=ratios, baseline_throughput=baselines,
            fidelity_vs_ar=fid.get("vs_ar", {}).get("match_rate"),
            fidelity_vs_fp32=fid.get("vs_fp32", {}).get("match_rate"),
            rouge_l=(quality.get("rouge_l") or {}).get("value"),
            code_exact_match=(quality.get("code") or {}).get("exact_match"),
            elapsed_s=m.get("elapsed_s", 0.0), skipped=bool(m.get("skipped", False)), document=m)

    def to_dict(self) -> dict:
        """The ``metrics.json`` document."""
        return self.document

    @property
    def rouge_l_written(self) -> float | None:
        """Mean ROUGE-L F1 of our text against the prompt suite's written answers (``None``: the suite gives none)."""
        return ((self.document.get("quality") or {}).get("rouge_l_written") or {}).get("value")

    @property
    def memory_mb(self) -> float:
        """Weights + peak KV in MiB (the memory objective)."""
        return self.total_peak_bytes / MB

    @property
    def ar_reference_throughput(self) -> float | None:
        """AR on the fp32 uncompressed target (``ar_fp32``) where it was measured, else the faster of HF's AR on the
        recipe's own target, eager (``ar``) or static cache + compile (``ar_static``): the strongest plain decoding a
        user of these weights has."""
        if "ar_fp32" in self.baseline_throughput:
            return self.baseline_throughput["ar_fp32"]
        measured = [self.baseline_throughput[m] for m in ("ar", "ar_static") if m in self.baseline_throughput]
        return max(measured) if measured else None

    def summary_line(self) -> str:
        """One line for the terminal: PPL, ROUGE-L and code exact match (vs fp32 AR), α, τ, speed, ratios, memory."""
        parts = [f"PPL {self.ppl:.2f}"]
        if self.ppl_ratio is not None:
            parts.append(f"(x{self.ppl_ratio:.3f} of fp32)")
        if self.rouge_l is not None:
            parts.append(f"ROUGE-L {self.rouge_l:.3f}")
        if self.rouge_l_written is not None:
            parts.append(f"ROUGE-L vs written answers {self.rouge_l_written:.3f}")
        if self.code_exact_match is not None:
            parts.append(f"code exact match {self.code_exact_match:.2f}")
        parts.append(f"α {self.acceptance_rate:.2f} τ {self.tokens_per_round:.2f}")
        batch = self.document.get("batch")
        parts.append(f"{self.throughput.median:.1f} tok/s [{self.throughput.min:.1f}-{self.throughput.max:.1f}]"
                     + (f" at batch size {batch['batch_size']} ({self.single_throughput.median:.1f} one request at a "
                        "time)" if batch else ""))
        parts += [f"{key} {value:.2f}x" for key, value in self.ratios.items()]
        parts.append(f"weights+KV {self.memory_mb:.1f} MiB")
        return ", ".join(parts)
