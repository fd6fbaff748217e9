"""Real text for distillation, as one token stream per split.

Default corpus (offline, real text): the Python standard-library sources of the running interpreter
(``os.path.dirname(os.__file__)``, top level, ``*.py``: code) plus the license texts under
``/usr/share/common-licenses`` (prose). Files are read with ``datasets.load_dataset("text", data_files=...,
sample_by="document")`` (one example per file). The held-out split is chosen *by file*, deterministically: a file is
held out when ``sha1(file name) / 2**160 < heldout_fraction``, separately within each group (code / prose), with at
least one file per group held out, so no held-out text is ever trained on.

``hub:NAME[:CONFIG]`` entries load a hub dataset (train split for training; validation, else test, for held-out)
through ``datasets.load_dataset(NAME, CONFIG)`` — only when the hub is reachable.

Each split is tokenized without special tokens, documents joined by the EOS id, into a 1-D ``int64`` tensor
``(num_tokens,)`` cached as ``.npy`` in the output directory, so a resumed run reads exactly the same stream.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import ConfigError

log = logging.getLogger(__name__)

LICENSES_DIR = Path("/usr/share/common-licenses")
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".java", ".go", ".rs",
                 ".tex", ".html", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ""}


def default_sources() -> dict[str, list[Path]]:
    """``{"code": stdlib *.py files, "prose": license texts}``, each sorted, symlinks resolved and deduplicated."""
    stdlib = Path(os.path.dirname(os.__file__))
    code = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    prose: list[Path] = []
    if LICENSES_DIR.is_dir():
        seen: set[Path] = set()
        for path in sorted(LICENSES_DIR.iterdir()):
            real = path.resolve()
            if real.is_file() and real not in seen:
                seen.add(real)
                prose.append(real)
    return {"code": code, "prose": prose}


def _expand(entry: str) -> list[Path]:
    path = Path(entry).expanduser()
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        return sorted(p.resolve() for p in path.rglob("*")
                      if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES and not any(
                          part.startswith(".") for part in p.relative_to(path).parts))
    matches = sorted(Path(m).resolve() for m in glob.glob(str(path), recursive=True) if Path(m).is_file())
    if not matches:
        raise ConfigError("data", f"{entry!r} is not a file, a directory or a glob matching any file")
    return matches


def split_files(files: list[Path], heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file name hash: returns ``(train, heldout)``; both non-empty when len(files) >= 2."""
    def score(path: Path) -> float:
        return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) / 2**160

    files = sorted(set(files))
    heldout = [p for p in files if score(p) < heldout_fraction]
    if not heldout and len(files) >= 2:
        heldout = [min(files, key=score)]
    if len(heldout) == len(files) and len(files) >= 2:
        heldout = heldout[:1]
    train = [p for p in files if p not in heldout]
    return train, heldout


def resolve_files(data: list[str], heldout_fraction: float) -> dict[str, list[str]]:
    """Local data entries -> ``{"train": [...], "heldout": [...]}`` (absolute paths as strings).

    Raises :class:`ConfigError` (field ``data``) when nothing is found or there are too few files to hold one out.
    """
    if data:
        groups = {"data": [p for entry in data for p in _expand(entry)]}
    else:
        groups = default_sources()
    train: list[Path] = []
    heldout: list[Path] = []
    for name, files in groups.items():
        if not files:
            continue
        t, h = split_files(files, heldout_fraction)
        train += t
        heldout += h
    if not train or not heldout:
        raise ConfigError("data", "needs at least two text files (one is held out for evaluation); found "
                          f"{len(train) + len(heldout)}")
    return {"train": [str(p) for p in train], "heldout": [str(p) for p in heldout]}


def _load_texts(data: list[str], heldout_fraction: float) -> tuple[dict[str, list[str]], dict]:
    """Documents per split and a manifest describing where they came from."""
    from datasets import load_dataset

    hub = [d for d in data if d.startswith("hub:")]
    local = [d for d in data if not d.startswith("hub:")]
    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    manifest: dict = {"files": {}, "hub": []}
    if local or not hub:
        files = resolve_files(local, heldout_fraction)
        manifest["files"] = files
        ds = load_dataset("text", data_files=files, sample_by="document", encoding_errors="replace")
        for split in ("train", "heldout"):
            texts[split] += [t for t in ds[split]["text"] if t and t.strip()]
    for entry in hub:
        name, _, config = entry[len("hub:"):].partition(":")
        try:
            ds = load_dataset(name, config or None)
        except Exception as exc:  # offline, unknown name, gated ...
            raise ConfigError("data", f"hub dataset {entry!r} could not be loaded (offline?): "
                              f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        held = "validation" if "validation" in ds else "test" if "test" in ds else None
        if "train" not in ds or held is None:
            raise ConfigError("data", f"hub dataset {entry!r} needs a train and a validation or test split")
        column = "text" if "text" in ds["train"].column_names else ds["train"].column_names[0]
        texts["train"] += [t for t in ds["train"][column] if t and t.strip()]
        texts["heldout"] += [t for t in ds[held][column] if t and t.strip()]
        manifest["hub"].append({"entry": entry, "heldout_split": held, "column": column})
    return texts, manifest


def tokenize_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """Documents -> one ``int64`` stream ``(num_tokens,)``, documents separated by the EOS id (when there is one)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    batch = 64
    for i in range(0, len(texts), batch):
        encoded = tokenizer(texts[i:i + batch], add_special_tokens=False)["input_ids"]
        for doc in encoded:
            ids.extend(doc)
            if eos is not None:
                ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def _save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a unique temporary sibling, fsynced and renamed into place (read back without pickle)."""
    from toolkit.io import atomic_write

    atomic_write(path, lambda tmp: np.save(tmp, array, allow_pickle=False), suffix=".npy", durable=True)


def load_streams(data: list[str], heldout_fraction: float, tokenizer, cache: Path) -> tuple[dict[str, torch.Tensor],
                                                                                              dict]:
    """Token streams ``{"train": (n_train,), "heldout": (n_heldout,)}`` (int64) and the data manifest.

    Streams are cached in ``cache`` (``train.npy``, ``heldout.npy``, ``manifest.json``); an existing cache is read
    back as is (a resumed run sees the very same tokens). Raises :class:`ConfigError` (field ``data``).
    """
    import json

    from toolkit.io import atomic_write_json

    train_path, held_path, manifest_path = cache / "train.npy", cache / "heldout.npy", cache / "manifest.json"
    if train_path.is_file() and held_path.is_file() and manifest_path.is_file():
        streams = {split: torch.from_numpy(np.load(path, allow_pickle=False))
                   for split, path in (("train", train_path), ("heldout", held_path))}
        return streams, json.loads(manifest_path.read_text())
    texts, manifest = _load_texts(data, heldout_fraction)
    streams = {split: tokenize_stream(texts[split], tokenizer) for split in ("train", "heldout")}
    manifest["tokens"] = {split: int(s.numel()) for split, s in streams.items()}
    manifest["documents"] = {split: len(texts[split]) for split in texts}
    for split, stream in streams.items():
        if stream.numel() < 2:
            raise ConfigError("data", f"the {split} split has only {stream.numel()} tokens")
    _save_npy(train_path, streams["train"].numpy())
    _save_npy(held_path, streams["heldout"].numpy())
    atomic_write_json(manifest_path, manifest, durable=True)
    return streams, manifest


class BlockSampler:
    """Deterministic batches of contiguous blocks from a token stream, addressable by step.

    The stream ``(n,)`` is cut into ``n // seq_len`` non-overlapping blocks of ``seq_len`` tokens; epoch e visits
    them in the order ``randperm(num_blocks, seed + e)``. ``batch(step)`` returns ``(batch_size, seq_len)`` int64 —
    a pure function of ``step``, so resuming at step s reproduces the exact data order (the data position is the
    step). Raises :class:`ConfigError` (field ``seq_len``) when the stream holds fewer than ``batch_size`` blocks.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_blocks = stream.numel() // seq_len
        if self.num_blocks < batch_size:
            raise ConfigError("seq_len", f"the training stream ({stream.numel()} tokens) holds {self.num_blocks} "
                              f"blocks of {seq_len} tokens, fewer than batch_size={batch_size}; add data or shrink "
                              "seq_len / batch_size")
        self.blocks = stream[: self.num_blocks * seq_len].view(self.num_blocks, seq_len)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.num_blocks, generator=gen)}
        return self._orders[epoch]

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, block offset within the epoch)`` where the batch of ``step`` starts."""
        start = step * self.batch_size
        return start // self.num_blocks, start % self.num_blocks

    def batch(self, step: int) -> torch.Tensor:
        rows = []
        for i in range(self.batch_size):
            index = step * self.batch_size + i
            epoch, offset = divmod(index, self.num_blocks)
            rows.append(self.blocks[self._order(epoch)[offset]])
        return torch.stack(rows)


def heldout_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens at evenly spaced offsets of the held-out stream: ``(count', length)``.

    ``count'`` is ``min(count, n // length)`` (windows never overlap); ``(0, length)`` when the stream is too short.
    """
    available = stream.numel() // length
    count = min(count, available)
    if count <= 0:
        return stream.new_empty((0, length))
    stride = available // count
    return torch.stack([stream[i * stride * length: (i * stride + 1) * length] for i in range(count)])
