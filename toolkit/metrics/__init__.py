"""The toolkit's metrics as Hugging Face ``evaluate`` modules, shipped inside the package and loaded offline by path.

Each module is ``toolkit/metrics/<name>/<name>.py``, an ``evaluate.Metric`` subclass in the layout of HF evaluate's
own metric scripts (``_info`` with features, description and citation; ``_compute``)::

    >>> import toolkit.metrics
    >>> rouge = toolkit.metrics.load("rouge_l")            # = evaluate.load(str(toolkit.metrics.path("rouge_l")))
    >>> rouge.compute(predictions=["the cat lay on the mat"], references=["the cat sat on the mat"])["rouge_l"]
    0.8333333333333334
    >>> toolkit.metrics.combine(["acceptance_rate", "tokens_per_round"]).compute(
    ...     accepted=[3, 1], drafted=[4, 4], committed=[5, 3], rounds=[2, 2])
    {'acceptance_rate': 0.5, 'accepted': 4, 'drafted': 8, 'tokens_per_round': 2.0, 'committed': 8, 'rounds': 4}

=====================  ==========================================  =================================================
module                 inputs (per sample)                         outputs
=====================  ==========================================  =================================================
``rouge_l``            ``predictions``, ``references``: texts      ROUGE-L F1 / precision / recall (Lin 2004)
``first_divergence``   ``predictions``, ``references``: token ids  ``exact_match``, ``matched_fraction``, the index
``acceptance_rate``    ``accepted``, ``drafted`` (tokens)          α = Σ accepted / Σ drafted
``tokens_per_round``   ``committed``, ``rounds``                   τ = Σ committed / Σ rounds (AR = 1.0)
``kv_bytes``           ``kv_bytes``, ``uncompressed_kv_bytes``     peak / mean bytes, compression ratio (removed)
``cache_perplexity``   ``nll_sum`` (nats), ``tokens``              exp(Σ nll / Σ tokens) under the (compressed) cache
=====================  ==========================================  =================================================

The last four aggregate precomputed per-sample values (a generation's ``GenerationStats``, a perplexity pass), so any
decoder's numbers are scored the same way; they ignore inputs they do not take, so ``evaluate.combine`` can pass one
set of inputs to all of them.

Offline: a name resolves to the shipped script's absolute path (``.../<name>/<name>.py``), which ``evaluate`` loads
as a local file, never from the Hugging Face Hub: no network is needed or touched, whether or not
``HF_EVALUATE_OFFLINE`` / ``HF_HUB_OFFLINE`` are set (tests run it with both set and sockets refused).
Cache: ``evaluate`` copies the script into ``$HF_MODULES_CACHE`` (default ``~/.cache/huggingface/modules``; set the
variable before ``evaluate`` is imported to move it) under ``evaluate_modules/metrics/<name>/<hash of the script>/``
and imports it from there; it also creates ``$HF_METRICS_CACHE/<name>/default/``. Concurrency: ``evaluate`` copies
under a file lock (``.../metrics/<name>.lock``); :func:`load` first replaces, under that lock, a copy that differs
from the shipped script (one left half-written by a killed process), and loads with ``keep_in_memory=True`` so a
computation never writes or shares an Arrow cache file — two processes (or threads) can load and compute at once.
"""

from __future__ import annotations

import threading
from pathlib import Path

from toolkit.errors import ConfigError

#: the shipped modules (``toolkit/metrics/<name>/<name>.py``)
NAMES = ("rouge_l", "first_divergence", "acceptance_rate", "tokens_per_round", "kv_bytes", "cache_perplexity")
ROOT = Path(__file__).resolve().parent
_LOCK = threading.Lock()  # one load at a time in this process (evaluate's file lock serializes processes)


def path(name: str) -> Path:
    """Absolute directory of the shipped module ``name``: ``evaluate.load(str(path(name)))`` loads it.

    Raises:
        ConfigError: unknown name (field ``metric``; the allowed names are listed).
        FileNotFoundError: the script is missing from this installation (a broken wheel).
    """
    if name not in NAMES:
        raise ConfigError("metric", f"unknown metric module {name!r}", NAMES)
    script = ROOT / name / f"{name}.py"
    if not script.is_file():
        raise FileNotFoundError(f"metric module {name!r}: {script} is missing from this installation")
    return script.parent


def load(name: str, **kwargs):
    """The ``evaluate.EvaluationModule`` of the shipped module ``name``, loaded from its file (offline, see the
    module docstring). ``kwargs`` go to ``evaluate.load`` (``keep_in_memory`` defaults to ``True``).

    Raises:
        ConfigError / FileNotFoundError: as :func:`path`.
        ImportError: ``evaluate`` (or a module's dependency such as ``rouge_score``) is not installed.
    """
    import evaluate

    script = path(name) / f"{name}.py"
    kwargs.setdefault("keep_in_memory", True)
    with _LOCK:
        _replace_stale_copy(script)
        return evaluate.load(str(script), **kwargs)


def combine(names: list[str], force_prefix: bool = False):
    """``evaluate.combine`` of the shipped modules ``names`` (outputs merged; prefixed by module name on a clash or
    with ``force_prefix``). Raises as :func:`load`."""
    import evaluate

    return evaluate.combine([load(n) for n in names], force_prefix=force_prefix)


def _replace_stale_copy(script: Path) -> None:
    """Remove ``evaluate``'s cached copy of ``script`` when it differs from the script (a copy cut short), under the
    lock ``evaluate`` itself takes for that copy; ``evaluate.load`` then copies it afresh."""
    try:
        from evaluate import config
        from evaluate.loading import files_to_hash
        from filelock import FileLock
    except ImportError:  # another evaluate layout: leave its cache to it
        return
    folder = Path(config.HF_MODULES_CACHE) / config.MODULE_NAME_FOR_DYNAMIC_MODULES / "metrics" / script.stem
    copy = folder / files_to_hash([str(script)]) / script.name
    if not copy.exists():
        return
    with FileLock(str(folder) + ".lock"):
        if copy.exists() and copy.read_bytes() != script.read_bytes():
            copy.unlink()
