"""Real held-out text for perplexity, loaded through ``datasets``.

Sources (``name`` argument of :func:`load_text`):

* ``prose`` — license and documentation texts installed on every Debian-like system and with every Python
  (``/usr/share/common-licenses/*``, Python's own ``LICENSE.txt``).
* ``code`` — Python standard-library sources of the running interpreter.
* ``wikitext`` — ``wikitext-2-raw-v1`` (test split) from the HF hub, only when the hub is reachable.
* ``pg19`` — ``deepmind/pg19`` (test split, streamed), only when the hub is reachable.

Held-out split: local documents are assigned to ``train`` / ``validation`` / ``test`` by a stable hash of their file
name (70/10/20), so a distillation run that trains on ``split="train"`` never sees the evaluator's ``test`` text.
Each local source pins at least one document per split so that small installations still have a test split.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("prose", "code", "wikitext", "pg19")
SPLITS = ("train", "validation", "test")

# Pinned documents (always present on Debian/Ubuntu + any CPython): these go to the test split first.
_PINNED_TEST = {
    "prose": ["GPL-3", "Apache-2.0"],
    "code": ["textwrap.py", "difflib.py", "argparse.py"],
}
_STDLIB_CODE = [
    "textwrap.py", "difflib.py", "argparse.py", "json/decoder.py", "json/encoder.py", "csv.py", "heapq.py",
    "bisect.py", "functools.py", "statistics.py", "fractions.py", "shlex.py", "string.py", "pprint.py",
    "dataclasses.py", "enum.py", "calendar.py", "configparser.py", "tokenize.py", "gettext.py", "glob.py",
    "fnmatch.py", "shutil.py", "tempfile.py", "contextlib.py", "operator.py", "copy.py", "random.py",
]


def split_of(name: str, source: str) -> str:
    """``train`` / ``validation`` / ``test`` for a document name (stable hash; pinned test documents first)."""
    if os.path.basename(name) in _PINNED_TEST.get(source, []) or name in _PINNED_TEST.get(source, []):
        return "test"
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10
    return "train" if bucket < 7 else ("validation" if bucket < 8 else "test")


def local_files(source: str) -> list[Path]:
    """Existing local files of a local source, in a fixed order (pinned test documents first)."""
    if source == "prose":
        base = Path("/usr/share/common-licenses")
        names = _PINNED_TEST["prose"] + sorted(p.name for p in base.glob("*") if p.is_file()) if base.is_dir() else []
        files = [base / n for n in dict.fromkeys(names) if (base / n).is_file()]
        py_license = Path(os.path.dirname(os.__file__)) / "LICENSE.txt"
        if py_license.is_file():
            files.append(py_license)
        # GPL -> GPL-3 and friends are symlinks/copies: keep each text once (the pinned test copy first)
        seen, unique = set(), []
        for f in files:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                unique.append(f)
        return unique
    if source == "code":
        stdlib = Path(os.path.dirname(os.__file__))
        return [stdlib / n for n in _STDLIB_CODE if (stdlib / n).is_file()]
    raise ValueError(f"source: {source!r} is not a local source (allowed: prose, code)")


def _hub_text(source: str, max_chars: int) -> str:
    from datasets import load_dataset

    if source == "wikitext":
        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        return "\n\n".join(ds["text"])[:max_chars]
    ds = load_dataset("deepmind/pg19", split="test", streaming=True)
    chunks, total = [], 0
    for row in ds:
        chunks.append(row["text"])
        total += len(row["text"])
        if total >= max_chars:
            break
    return "\n\n".join(chunks)[:max_chars]


def load_text(source: str = "prose", split: str = "test", max_chars: int = 200_000) -> str:
    """Concatenated text of ``source``'s ``split`` (documents joined by blank lines), at most ``max_chars``.

    Local sources are read with ``datasets.load_dataset("text", data_files=..., sample_by="document")``.

    Raises:
        ValueError: unknown source or split.
        RuntimeError: the source has no text here (hub unreachable, no local files).
    """
    if source not in SOURCES:
        raise ValueError(f"source: unknown text source {source!r} (allowed: {', '.join(SOURCES)})")
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r} (allowed: {', '.join(SPLITS)})")
    if source in ("wikitext", "pg19"):
        if split != "test":
            raise ValueError(f"split: hub source {source!r} is used for evaluation only (split 'test')")
        try:
            return _hub_text(source, max_chars)
        except Exception as exc:  # offline, gated, missing — say so plainly
            raise RuntimeError(f"text source {source!r} needs the HF hub, which is not reachable here "
                               f"({exc.__class__.__name__}); use 'prose' or 'code'") from exc
    files = [f for f in local_files(source) if split_of(f.name if source == "prose" else
                                                        str(f.relative_to(Path(os.path.dirname(os.__file__)))),
                                                        source) == split]
    if not files:
        raise RuntimeError(f"text source {source!r} has no {split} documents on this machine")
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    ds = load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train",
                      keep_in_memory=True)
    return "\n\n".join(ds["text"])[:max_chars]


def heldout_ids(tokenizer, source: str = "prose", num_tokens: int = 1024, split: str = "test") -> list[int]:
    """The first ``num_tokens`` token ids of ``source``'s held-out text (BOS not added).

    Raises:
        RuntimeError: the text is shorter than ``num_tokens`` tokens.
    """
    text = load_text(source, split, max_chars=max(20_000, num_tokens * 8))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < num_tokens:
        raise RuntimeError(f"text source {source!r} ({split}) has only {len(ids)} tokens, {num_tokens} requested")
    return list(ids[:num_tokens])


def describe(source: str, split: str = "test") -> str:
    """One-line provenance of a text source for reports."""
    if source in ("wikitext", "pg19"):
        return {"wikitext": "wikitext-2-raw-v1 (test)", "pg19": "deepmind/pg19 (test)"}[source]
    stdlib = Path(os.path.dirname(os.__file__))
    names = [f.name if source == "prose" else str(f.relative_to(stdlib)) for f in local_files(source)]
    picked = [n for n in names if split_of(n, source) == split]
    where = "/usr/share/common-licenses" if source == "prose" else f"Python {sys.version.split()[0]} stdlib"
    return f"{source} ({split} split of {where}): {', '.join(picked[:6])}{' ...' if len(picked) > 6 else ''}"
