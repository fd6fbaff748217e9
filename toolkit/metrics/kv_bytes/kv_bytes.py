"""Exact KV-cache bytes and the fraction a compressed cache removes: an HF ``evaluate`` metric module shipped with the
toolkit (``toolkit.metrics.load("kv_bytes")``)."""

import datasets
import evaluate

_CITATION = """\
@inproceedings{xiao2024efficient,
    title = {Efficient Streaming Language Models with Attention Sinks},
    author = {Xiao, Guangxuan and Tian, Yuandong and Chen, Beidi and Han, Song and Lewis, Mike},
    booktitle = {The Twelfth International Conference on Learning Representations},
    year = {2024},
}
"""

_DESCRIPTION = """\
KV-cache memory from precomputed per-sample byte counts: `kv_bytes` is the exact size of a sample's cache (the sum
of its tensors' `nbytes`, e.g. the peak over a generation), `uncompressed_kv_bytes` the size an uncompressed cache
would have at the same length (bytes per token x tokens). Reported: the peak (max) and mean of each, and the
compression ratio = 1 - sum(kv_bytes) / sum(uncompressed_kv_bytes), the fraction of bytes removed (0.0 for an
uncompressed cache; can be negative when a cache holds more than the uncompressed one, e.g. preallocated buffers).
"""

_KWARGS_DESCRIPTION = """
Args:
    kv_bytes (list of int): exact KV bytes per sample (>= 0).
    uncompressed_kv_bytes (list of int): bytes of an uncompressed cache at the same length, per sample (>= 0).
    Other keyword inputs (those of other modules in an evaluate.combine) are ignored.
Returns:
    kv_bytes_peak / kv_bytes_mean: max and mean of kv_bytes (bytes).
    uncompressed_kv_bytes_peak: max of uncompressed_kv_bytes (bytes).
    kv_compression_ratio: 1 - sum(kv_bytes) / sum(uncompressed_kv_bytes) (0.0 when the latter sum is 0).
Raises:
    ValueError: a negative byte count, or no samples.
Examples:
    >>> toolkit.metrics.load("kv_bytes").compute(kv_bytes=[100, 300], uncompressed_kv_bytes=[400, 400])
    {'kv_bytes_peak': 300, 'kv_bytes_mean': 200.0, 'uncompressed_kv_bytes_peak': 400, 'kv_compression_ratio': 0.5}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class KvBytes(evaluate.Metric):
    """Peak / mean KV bytes and the compression ratio (module name ``kv_bytes``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"kv_bytes": datasets.Value("int64"),
                                        "uncompressed_kv_bytes": datasets.Value("int64")}),
            reference_urls=["https://arxiv.org/abs/2309.17453"],
        )

    def _compute(self, kv_bytes, uncompressed_kv_bytes, **other_inputs):
        if not kv_bytes:
            raise ValueError("kv_bytes: no samples")
        if min(kv_bytes) < 0 or min(uncompressed_kv_bytes) < 0:
            raise ValueError("kv_bytes / uncompressed_kv_bytes: byte counts must be >= 0")
        full = int(sum(uncompressed_kv_bytes))
        return {"kv_bytes_peak": int(max(kv_bytes)), "kv_bytes_mean": sum(kv_bytes) / len(kv_bytes),
                "uncompressed_kv_bytes_peak": int(max(uncompressed_kv_bytes)),
                "kv_compression_ratio": 1.0 - sum(kv_bytes) / full if full else 0.0}
