"""Exact match and first divergence of generated token ids against reference token ids: an HF ``evaluate`` metric
module shipped with the toolkit.

Load it by path (no hub, no network): ``toolkit.metrics.load("first_divergence")`` or
``evaluate.load("/abs/path/to/toolkit/metrics/first_divergence")``.
"""

import datasets
import evaluate

_CITATION = """\
@inproceedings{leviathan2023fast,
    title = {Fast Inference from Transformers via Speculative Decoding},
    author = {Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
    booktitle = {Proceedings of the 40th International Conference on Machine Learning},
    year = {2023},
}
"""

_DESCRIPTION = """\
Token-level agreement of a generated continuation with a reference continuation of the same prompt (both lists of
token ids, new tokens only). Greedy speculative decoding at fp32 without KV compression reproduces the target's
autoregressive output exactly (Leviathan et al. 2023); a compressed cache or lower precision may not, and this says
where the text first departs:

* first_divergence: the first index i with prediction[i] != reference[i]; when one sequence is a proper prefix of
  the other, the shorter length; None when the sequences are identical.
* exact_match: 1 when the sequences are identical (same length, same ids), else 0.
* matched_fraction: the fraction of the reference matched before the first divergence, first_divergence /
  len(reference) (1.0 when identical; 0.0 for a non-empty prediction of an empty reference).

The toolkit's evaluator scores a compressed recipe's output on code prompts against the fp32 autoregressive
reference with it (code is judged by exact tokens, not by word overlap).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of list of int): generated token ids, one sequence per pair.
    references (list of list of int): reference token ids, one sequence per prediction.
    use_aggregator (bool, default True): exact_match and matched_fraction as means over the pairs; False returns
        one value per pair. first_divergence is always one index (or None) per pair.
Returns:
    exact_match: fraction of identical pairs (or 0/1 per pair), in [0, 1].
    matched_fraction: mean fraction of the reference before the first divergence (or one per pair), in [0, 1].
    first_divergence: list of int or None, one per pair (token index).
Raises:
    ValueError: predictions and references of different lengths, or no pairs.
Examples:
    >>> first_divergence = toolkit.metrics.load("first_divergence")
    >>> first_divergence.compute(predictions=[[5, 6, 7, 9]], references=[[5, 6, 7, 8]])
    {'exact_match': 0.0, 'matched_fraction': 0.75, 'first_divergence': [3]}
"""


def _divergence(prediction, reference):
    """First differing index of two id lists (the shorter length for a proper prefix); None when identical."""
    for i, (a, b) in enumerate(zip(prediction, reference)):
        if a != b:
            return i
    return None if len(prediction) == len(reference) else min(len(prediction), len(reference))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class FirstDivergence(evaluate.Metric):
    """Exact match, first divergence and matched fraction of token ids (module name ``first_divergence``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int64")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}),
            reference_urls=["https://arxiv.org/abs/2211.17192"],
        )

    def _compute(self, predictions, references, use_aggregator=True):
        if len(predictions) != len(references):
            raise ValueError(f"predictions: {len(predictions)} sequences for {len(references)} references")
        if not predictions:
            raise ValueError("predictions: no pairs to score")
        index = [_divergence(list(p), list(r)) for p, r in zip(predictions, references)]
        exact = [1.0 if i is None else 0.0 for i in index]
        matched = [1.0 if i is None else (i / len(r) if len(r) else 0.0) for i, r in zip(index, references)]
        if use_aggregator:
            return {"exact_match": sum(exact) / len(exact), "matched_fraction": sum(matched) / len(matched),
                    "first_divergence": index}
        return {"exact_match": exact, "matched_fraction": matched, "first_divergence": index}
