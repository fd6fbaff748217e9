"""Acceptance rate alpha of speculative decoding from per-sample counters: an HF ``evaluate`` metric module shipped
with the toolkit (``toolkit.metrics.load("acceptance_rate")``)."""

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
Acceptance rate alpha = sum(accepted) / sum(drafted) over samples (token-weighted, like the toolkit's
`acceptance_summary`): the fraction of draft tokens the target accepted. 0.0 when nothing was drafted. The inputs are
precomputed per-sample counters (a generation's `GenerationStats.accepted` and `.drafted`, in tokens); the module
only aggregates them, so any decoder's counts can be scored the same way.
"""

_KWARGS_DESCRIPTION = """
Args:
    accepted (list of int): draft tokens accepted per sample (>= 0, <= drafted).
    drafted (list of int): draft tokens proposed per sample (>= 0).
    Other keyword inputs (those of other modules in an evaluate.combine) are ignored.
Returns:
    acceptance_rate: sum(accepted) / sum(drafted), in [0, 1].
    accepted / drafted: the sums (tokens).
Raises:
    ValueError: a negative count, or accepted > drafted in a sample.
Examples:
    >>> toolkit.metrics.load("acceptance_rate").compute(accepted=[3, 1], drafted=[4, 4])
    {'acceptance_rate': 0.5, 'accepted': 4, 'drafted': 8}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class AcceptanceRate(evaluate.Metric):
    """alpha = accepted / drafted (module name ``acceptance_rate``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"accepted": datasets.Value("int64"), "drafted": datasets.Value("int64")}),
            reference_urls=["https://arxiv.org/abs/2211.17192"],
        )

    def _compute(self, accepted, drafted, **other_inputs):
        for i, (a, d) in enumerate(zip(accepted, drafted)):
            if a < 0 or d < 0 or a > d:
                raise ValueError(f"sample {i}: need 0 <= accepted <= drafted, got accepted={a}, drafted={d}")
        total_a, total_d = int(sum(accepted)), int(sum(drafted))
        return {"acceptance_rate": total_a / total_d if total_d else 0.0, "accepted": total_a, "drafted": total_d}
