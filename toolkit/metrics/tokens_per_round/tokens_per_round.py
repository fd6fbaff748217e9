"""Mean accepted length tau (tokens committed per round) of speculative decoding from per-sample counters: an HF
``evaluate`` metric module shipped with the toolkit (``toolkit.metrics.load("tokens_per_round")``)."""

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
Mean accepted length tau = sum(committed) / sum(rounds) over samples: tokens committed per draft+verify round
(accepted draft tokens plus the one token the target adds per round; autoregressive decoding has tau = 1.0). 0.0 when
no round ran. The inputs are precomputed per-sample counters (`GenerationStats.committed` and `.rounds`); the module
only aggregates them.
"""

_KWARGS_DESCRIPTION = """
Args:
    committed (list of int): tokens committed per sample (>= 0).
    rounds (list of int): draft+verify rounds per sample (>= 0).
    Other keyword inputs (those of other modules in an evaluate.combine) are ignored.
Returns:
    tokens_per_round: sum(committed) / sum(rounds) (tokens per round, >= 0).
    committed / rounds: the sums.
Raises:
    ValueError: a negative count.
Examples:
    >>> toolkit.metrics.load("tokens_per_round").compute(committed=[9, 3], rounds=[3, 3])
    {'tokens_per_round': 2.0, 'committed': 12, 'rounds': 6}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokensPerRound(evaluate.Metric):
    """tau = committed / rounds (module name ``tokens_per_round``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"committed": datasets.Value("int64"), "rounds": datasets.Value("int64")}),
            reference_urls=["https://arxiv.org/abs/2211.17192"],
        )

    def _compute(self, committed, rounds, **other_inputs):
        for i, (c, r) in enumerate(zip(committed, rounds)):
            if c < 0 or r < 0:
                raise ValueError(f"sample {i}: counts must be >= 0, got committed={c}, rounds={r}")
        total_c, total_r = int(sum(committed)), int(sum(rounds))
        return {"tokens_per_round": total_c / total_r if total_r else 0.0, "committed": total_c, "rounds": total_r}
