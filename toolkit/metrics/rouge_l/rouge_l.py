"""ROUGE-L of generated text against a reference text: an HF ``evaluate`` metric module shipped with the toolkit.

Load it by path (no hub, no network): ``toolkit.metrics.load("rouge_l")`` or
``evaluate.load("/abs/path/to/toolkit/metrics/rouge_l")``.
"""

import datasets
import evaluate
from rouge_score import rouge_scorer

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    month = jul,
    year = "2004",
    address = "Barcelona, Spain",
    publisher = "Association for Computational Linguistics",
    url = "https://aclanthology.org/W04-1013",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-L (Lin 2004): the longest common subsequence (LCS) of the prediction's and the reference's words. With
LCS = |LCS(prediction, reference)| in words, precision = LCS / len(prediction), recall = LCS / len(reference),
F1 = 2 * precision * recall / (precision + recall) (0 when either text has no words). Identical texts score 1.0.

Words come from Google's `rouge_score` tokenizer (the reference implementation HF's own `rouge` metric uses):
lower-cased, every run of characters outside [a-z0-9] is a separator, optional Porter stemming of words longer than
three characters. Non-ASCII letters are separators too. Sentence-level LCS over the whole text (`rougeL`, not
`rougeLsum`). Aggregates are plain means over the pairs (no bootstrap resampling: deterministic).

The toolkit's evaluator scores a compressed recipe's generated text against the fp32 autoregressive reference text
of the same summarization prompt with it.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated texts.
    references (list of str): one reference text per prediction.
    use_stemmer (bool, default False): Porter-stem words longer than three characters before matching.
    use_aggregator (bool, default True): return means over the pairs; False returns one value per pair.
Returns:
    rouge_l: F1 of ROUGE-L, in [0, 1] (mean, or a list with use_aggregator=False).
    rouge_l_precision: LCS / prediction words, in [0, 1].
    rouge_l_recall: LCS / reference words, in [0, 1].
Raises:
    ValueError: predictions and references of different lengths, or no pairs.
Examples:
    >>> rouge_l = toolkit.metrics.load("rouge_l")
    >>> rouge_l.compute(predictions=["the cat lay on the mat"], references=["the cat sat on the mat"])
    {'rouge_l': 0.8333333333333334, 'rouge_l_precision': 0.8333333333333334, 'rouge_l_recall': 0.8333333333333334}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RougeL(evaluate.Metric):
    """ROUGE-L F1 / precision / recall (module name ``rouge_l``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
            reference_urls=["https://aclanthology.org/W04-1013"],
        )

    def _compute(self, predictions, references, use_stemmer=False, use_aggregator=True):
        if len(predictions) != len(references):
            raise ValueError(f"predictions: {len(predictions)} texts for {len(references)} references")
        if not predictions:
            raise ValueError("predictions: no pairs to score")
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=bool(use_stemmer))
        scores = [scorer.score(ref, pred)["rougeL"] for pred, ref in zip(predictions, references)]
        out = {"rouge_l": [float(s.fmeasure) for s in scores],
               "rouge_l_precision": [float(s.precision) for s in scores],
               "rouge_l_recall": [float(s.recall) for s in scores]}
        if use_aggregator:
            out = {key: sum(values) / len(values) for key, values in out.items()}
        return out
