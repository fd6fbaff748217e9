"""Perplexity under a (compressed) KV cache from precomputed per-sample negative log-likelihoods: an HF ``evaluate``
metric module shipped with the toolkit (``toolkit.metrics.load("cache_perplexity")``)."""

import math

import datasets
import evaluate

_CITATION = """\
@misc{hf-perplexity,
    title = {Perplexity of fixed-length models},
    author = {{Hugging Face}},
    howpublished = {https://huggingface.co/docs/transformers/perplexity},
}
"""

_DESCRIPTION = """\
Token-level perplexity = exp(sum(nll_sum) / sum(tokens)) over samples, natural log: each sample gives the summed
negative log-likelihood of its predicted tokens and how many tokens were predicted. In the toolkit those come from
teacher-forcing held-out text through the recipe's cache with its KV policy active (chunks of K + 1 tokens,
compression at every commit point: `perplexity_through_cache` of the toolkit's evaluator), so the value is the
perplexity the target has under its compressed cache. Samples are weighted by their token counts (not a mean of
per-sample perplexities).
"""

_KWARGS_DESCRIPTION = """
Args:
    nll_sum (list of float): summed negative log-likelihood per sample (nats, >= 0).
    tokens (list of int): predicted tokens per sample (>= 0; their sum > 0).
    Other keyword inputs (those of other modules in an evaluate.combine) are ignored.
Returns:
    perplexity: exp(sum(nll_sum) / sum(tokens)).
    nll_mean: sum(nll_sum) / sum(tokens) (nats per token).
    tokens: sum(tokens).
Raises:
    ValueError: a negative or non-finite value, or no predicted tokens.
Examples:
    >>> toolkit.metrics.load("cache_perplexity").compute(nll_sum=[2.0, 4.0], tokens=[2, 4])
    {'perplexity': 2.718281828459045, 'nll_mean': 1.0, 'tokens': 6}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CachePerplexity(evaluate.Metric):
    """exp(total NLL / total tokens) (module name ``cache_perplexity``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "tokens": datasets.Value("int64")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, nll_sum, tokens, **other_inputs):
        for i, (nll, n) in enumerate(zip(nll_sum, tokens)):
            if not math.isfinite(nll) or nll < 0 or n < 0:
                raise ValueError(f"sample {i}: need a finite nll_sum >= 0 and tokens >= 0, got {nll}, {n}")
        total = int(sum(tokens))
        if total == 0:
            raise ValueError("tokens: no predicted tokens")
        mean = math.fsum(nll_sum) / total
        return {"perplexity": math.exp(mean), "nll_mean": mean, "tokens": total}
