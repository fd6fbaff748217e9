"""Training data for an EAGLE head: real local text plus the target's own answers to chat prompts, with the
target's features precomputed once.

* Text: the draft-distillation corpus (:func:`toolkit.distill.data.load_streams`: Python standard-library sources,
  license texts, and any ``--data`` entries such as ``/usr/share/doc``), cut into windows of ``seq_len`` tokens.
* Chat: instruction prompts built from templates over passages of that corpus (explain / summarise / document code,
  file-level train / held-out split as the corpus) and from topic lists; the target answers them greedily with
  ``generate`` in batches (bf16, left padding), for at most ``chat_minutes``. The head must learn the target's own
  distribution, which is what its answers are. Files used by the shipped prompt suites (``recipes/prompts``) are
  never used for chat prompts.
* Features: one batched forward of the target per window with a hook on the last decoder layer
  (:class:`toolkit.eagle.features.FeatureHook`), stored post-final-norm in bf16: ``features (n, seq_len, H)``,
  ``tokens (n, seq_len)`` int64, ``mask (n, seq_len)`` bool (valid positions), ``kind (n,)`` (0 text, 1 chat);
  for an EAGLE-3 head also ``aux (n, seq_len, 3H)``: the raw outputs of its three feature layers, concatenated.
  Saved to ``out/data/features-{split}.safetensors`` atomically and durably and reused by a resumed run. A feature
  cache is only ever read as safetensors (tensors, no code); a ``.pt`` pickle from an older version is ignored and
  recomputed, never unpickled.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import random
import time
from pathlib import Path

import torch

from toolkit.errors import ConfigError
from toolkit.io import atomic_write, atomic_write_json

log = logging.getLogger(__name__)

TOPICS = ["photosynthesis", "the water cycle", "how vaccines work", "compound interest", "recursion in programming",
          "the French Revolution", "black holes", "machine learning", "plate tectonics", "the immune system",
          "supply and demand", "the internet", "climate change", "how airplanes fly", "DNA replication",
          "the Roman Empire", "electric cars", "quantum computing", "the stock market", "sleep and memory",
          "public key cryptography", "volcanoes", "the theory of evolution", "inflation", "renewable energy",
          "version control with git", "how a compiler works", "the human heart", "ocean tides", "democracy",
          "hash tables", "binary search", "the printing press", "coral reefs", "antibiotics", "solar panels",
          "the moon landing", "operating systems", "rainbows", "earthquakes", "bees and pollination", "glaciers",
          "unit testing", "relational databases", "the Renaissance", "gravity", "neural networks", "coffee",
          "meditation", "the periodic table", "TCP and UDP", "garbage collection", "sorting algorithms"]
ACTIVITIES = ["learning a new language", "staying productive at home", "writing clean code", "saving money",
              "preparing for a job interview", "cooking healthy meals", "improving sleep", "giving a presentation",
              "studying for exams", "running a marathon", "reviewing pull requests", "debugging a program",
              "keeping a garden", "traveling on a budget", "writing an essay", "managing stress", "learning SQL"]
PAIRS = [("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "storage"),
         ("TCP", "UDP"), ("a process", "a thread"), ("speed", "velocity"), ("mitosis", "meiosis"),
         ("an interpreter", "a compiler"), ("stocks", "bonds"), ("HTTP", "HTTPS"), ("a class", "an object"),
         ("weight", "mass"), ("a comet", "an asteroid"), ("Git", "GitHub"), ("latency", "throughput")]
QUESTION_TEMPLATES = ["Explain {topic} in a short paragraph.", "What is {topic}? Answer simply.",
                      "Write three sentences about {topic} for a ten-year-old.",
                      "Give me a short overview of {topic}.", "Why is {topic} important?"]
CODE_TEMPLATES = ["Explain what the following Python code does.\n\n{passage}",
                  "Write a short docstring for the following code.\n\n{passage}",
                  "Is there a bug in this code? Explain briefly.\n\n{passage}",
                  "Complete the following Python code.\n\n{passage}"]
PROSE_TEMPLATES = ["Summarize the following passage in two or three sentences.\n\n{passage}",
                   "Explain the following text in plain words.\n\n{passage}",
                   "What are the key points of this passage?\n\n{passage}"]


def suite_files() -> set[str]:
    """File names used by the shipped prompt suites: never a source of training prompts."""
    import yaml

    names: set[str] = set()
    from toolkit.resources import shipped

    root = shipped("prompts")  # the shipped suites, also from an installed wheel
    for path in root.glob("*.yaml") if root.is_dir() else []:
        for entry in (yaml.safe_load(path.read_text()) or {}).get("prompts", []):
            for f in (entry.get("source") or {}).get("files", []):
                names.add(Path(str(f).split(":", 1)[-1]).name)
    return names


def _passages(paths: list[str], rng: random.Random, count: int, lines: int) -> list[str]:
    out = []
    excluded = suite_files()
    paths = [p for p in paths if Path(p).name not in excluded]
    if not paths:
        return out
    for _ in range(count * 3):
        if len(out) >= count:
            break
        path = rng.choice(paths)
        try:
            text = Path(path).read_text(errors="ignore").splitlines()
        except OSError:
            continue
        if len(text) < lines:
            continue
        start = rng.randrange(0, len(text) - lines + 1)
        chunk = "\n".join(text[start:start + lines]).strip()
        if len(chunk) > 80:
            out.append(chunk[:1200])
    return out


def chat_prompts(files: dict[str, list[str]], split: str, count: int, seed: int) -> list[str]:
    """``count`` user messages: topic questions (split by topic) and code / prose tasks over ``files[split]``."""
    rng = random.Random(seed + (0 if split == "train" else 7919))
    code = [f for f in files[split] if f.endswith(".py")]
    prose = [f for f in files[split] if not f.endswith(".py")]
    topics = [t for i, t in enumerate(TOPICS) if (i % 10 == 3) == (split == "heldout")]
    acts = [a for i, a in enumerate(ACTIVITIES) if (i % 6 == 2) == (split == "heldout")]
    pairs = [p for i, p in enumerate(PAIRS) if (i % 6 == 1) == (split == "heldout")]
    generic = [t.format(topic=x) for t in QUESTION_TEMPLATES for x in topics]
    generic += [f"Give me {n} practical tips for {a}." for a in acts for n in ("three", "five")]
    generic += [f"What is the difference between {a} and {b}?" for a, b in pairs]
    rng.shuffle(generic)
    n_generic = min(len(generic), count // 3)
    n_code = (count - n_generic) // 2
    prompts = generic[:n_generic]
    prompts += [rng.choice(CODE_TEMPLATES).format(passage=p) for p in _passages(code, rng, n_code, 12)]
    prompts += [rng.choice(PROSE_TEMPLATES).format(passage=p)
                for p in _passages(prose, rng, count - len(prompts), 10)]
    rng.shuffle(prompts)
    return prompts


@torch.inference_mode()
def generate_answers(target, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                     minutes: float, max_prompt_tokens: int) -> list[tuple[list[int], int]]:
    """Greedy answers of the target: each item is ``(prompt ids + answer ids, prompt length)`` (chat template
    applied, EOS kept). Stops starting new batches after ``minutes``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if len(ids) <= max_prompt_tokens:
            encoded.append(ids)
    encoded.sort(key=len)
    device = next(target.parameters()).device
    start = time.monotonic()
    sequences: list[tuple[list[int], int]] = []
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(0).shuffle(batches)
    for batch in batches:
        if time.monotonic() - start > minutes * 60:
            break
        width = max(len(x) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for row, prompt in zip(out[:, width:].tolist(), batch):
            answer = []
            for token in row:
                answer.append(token)
                if token == tokenizer.eos_token_id:
                    break
            sequences.append((prompt + answer, len(prompt)))
        log.info("chat answers: %d sequences, %.0f s", len(sequences), time.monotonic() - start)
    return sequences


@torch.inference_mode()
def compute_features(target, rows: list[list[int]], seq_len: int, pad: int, batch_size: int = 8,
                     aux_layers: list[int] | None = None) -> dict:
    """Target features for each row (truncated / right-padded to ``seq_len``): see the module docstring. With
    ``aux_layers`` (an EAGLE-3 head's feature layers) also ``aux`` ``(n, seq_len, len(aux_layers) * H)``: those
    layers' raw outputs concatenated, the head's step-1 input."""
    from toolkit.eagle.features import FeatureHook

    device = next(target.parameters()).device
    n = len(rows)
    hidden = target.config.get_text_config().hidden_size
    features = torch.zeros(n, seq_len, hidden, dtype=torch.bfloat16)
    aux = torch.zeros(n, seq_len, len(aux_layers) * hidden, dtype=torch.bfloat16) if aux_layers else None
    tokens = torch.full((n, seq_len), pad, dtype=torch.long)
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    for i, row in enumerate(rows):
        row = row[:seq_len]
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = True
    aux_hook = FeatureHook(target, aux_layers, normalize=False) if aux_layers else None
    try:
        with FeatureHook(target, [-1]) as hook:
            for s in range(0, n, batch_size):
                ids = tokens[s:s + batch_size].to(device)
                target(input_ids=ids, attention_mask=mask[s:s + batch_size].long().to(device), use_cache=False,
                       logits_to_keep=1)
                features[s:s + batch_size] = hook.features().to(torch.bfloat16).cpu()
                if aux_hook is not None:
                    aux[s:s + batch_size] = aux_hook.features().to(torch.bfloat16).cpu()
    finally:
        if aux_hook is not None:
            aux_hook.close()
    cache = {"features": features, "tokens": tokens, "mask": mask}
    if aux is not None:
        cache["aux"] = aux
    return cache


FEATURE_KEYS = ("features", "tokens", "mask", "kind", "answer_start")
#: the EAGLE-3 step-1 inputs, present in the caches of an EAGLE-3 run
AUX_KEY = "aux"


def save_features(cache: dict, path: Path) -> None:
    """Write the tensors of a feature cache (:data:`FEATURE_KEYS`) to ``path`` as safetensors, atomically and
    durably."""
    from safetensors.torch import save_file

    tensors = {key: cache[key].contiguous() for key in (*FEATURE_KEYS, AUX_KEY) if key in cache}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)), suffix=".safetensors", durable=True)


def load_features(path: Path) -> dict:
    """A feature cache written by :func:`save_features` (safetensors only: reading it runs no code).

    Raises:
        ConfigError (``data``): the file is not a safetensors feature cache.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        cache = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError("data", f"{path} is not a feature cache written by this toolkit ({exc}); delete it or "
                          "start over with --force") from exc
    missing = [key for key in FEATURE_KEYS if key not in cache]
    if missing:
        raise ConfigError("data", f"{path} lacks the tensors {missing}; delete it or start over with --force")
    return cache


def expand_data(entries: list[str]) -> list[str]:
    """Globs -> sorted existing regular files (``.gz`` and other compressed files skipped)."""
    files = set()
    for entry in entries:
        for path in glob.glob(os.path.expanduser(entry), recursive=True):
            p = Path(path)
            if p.is_file() and p.suffix not in (".gz", ".xz", ".bz2", ".zst"):
                files.add(str(p.resolve()))
    if not files:
        raise ConfigError("data", f"no file matches {entries}")
    return sorted(files)


def _cached(data_dir: Path, paths: dict[str, Path], aux_layers: list[int] | None) -> dict | None:
    """The feature caches and manifest of an earlier run in ``data_dir``, or None when incomplete or computed for
    other feature layers (an EAGLE-1 run's caches lack an EAGLE-3 head's inputs)."""
    manifest = data_dir / "eagle_manifest.json"
    if not (all(p.is_file() for p in paths.values()) and manifest.is_file()):
        for legacy in sorted(data_dir.glob("features-*.pt")):
            log.warning("ignoring %s: a pickled feature cache of an older version is never loaded (unpickling can "
                        "run code); the features are recomputed", legacy)
        return None
    manifest = json.loads(manifest.read_text())
    if manifest.get("aux_layers") != aux_layers:
        log.warning("the feature caches in %s were computed for feature layers %s, this run needs %s: recomputed",
                    data_dir, manifest.get("aux_layers"), aux_layers)
        return None
    return {s: load_features(p) for s, p in paths.items()} | {"manifest": manifest}


def _rows(config, split: dict, streams: dict, target, tokenizer) -> tuple[dict, dict, list[str]]:
    """``({split: chat rows}, {split: text rows}, held-out prompts)``: the target's greedy answers to chat prompts
    (``(ids, prompt length)`` each) and windows of ``seq_len`` tokens of local text."""
    held_prompts = chat_prompts(split, "heldout", config.heldout_prompts, config.seed)
    chat = {"heldout": generate_answers(target, tokenizer, held_prompts, config.chat_new_tokens, config.chat_batch,
                                        math.inf, config.seq_len - config.chat_new_tokens)}
    train_prompts = chat_prompts(split, "train", config.chat_prompts, config.seed)
    chat["train"] = generate_answers(target, tokenizer, train_prompts, config.chat_new_tokens, config.chat_batch,
                                     config.chat_minutes, config.seq_len - config.chat_new_tokens)
    text, held_text, seq_len = streams["train"], streams["heldout"], config.seq_len
    n_windows = min(config.text_windows, text.numel() // seq_len)
    gen = torch.Generator().manual_seed(config.seed)
    starts = torch.randperm(text.numel() // seq_len, generator=gen)[:n_windows] * seq_len
    texts = {"train": [text[s:s + seq_len].tolist() for s in starts.tolist()],
             "heldout": [held_text[i * seq_len:(i + 1) * seq_len].tolist()
                         for i in range(min(8, held_text.numel() // seq_len))]}
    return chat, texts, held_prompts


def prepare_data(config, target, tokenizer, aux_layers: list[int] | None = None) -> dict:
    """Build (or read back) ``{"train": cache, "heldout": cache, "manifest": ...}`` of feature caches for an
    :class:`~toolkit.distill.eagle_train.EagleTrainConfig` run, in ``config.out / "data"``; with ``aux_layers``
    (EAGLE-3) each cache also holds those layers' outputs (``aux``).

    Raises:
        ConfigError (``data``): no data file matches, or a cache in ``data/`` is not one this toolkit wrote.
    """
    from toolkit.distill.data import load_streams, resolve_files

    data_dir = config.out / "data"
    paths = {s: data_dir / f"features-{s}.safetensors" for s in ("train", "heldout")}
    cached = _cached(data_dir, paths, aux_layers)
    if cached is not None:
        return cached
    files = expand_data(config.data)
    split = resolve_files(files, 0.05)
    streams, _ = load_streams(files, 0.05, tokenizer, data_dir)
    t0 = time.monotonic()
    chat, texts, held_prompts = _rows(config, split, streams, target, tokenizer)
    chat_s, t1 = time.monotonic() - t0, time.monotonic()
    caches = {}
    for name in ("heldout", "train"):
        cache = compute_features(target, [r for r, _ in chat[name]] + texts[name], config.seq_len,
                                 tokenizer.eos_token_id, aux_layers=aux_layers)
        cache["kind"] = torch.tensor([1] * len(chat[name]) + [0] * len(texts[name]))
        cache["answer_start"] = torch.tensor([p for _, p in chat[name]] + [0] * len(texts[name]))
        save_features(cache, paths[name])
        caches[name] = cache
    manifest = {"files": split, "chat_sequences": {s: len(chat[s]) for s in ("train", "heldout")},
                "chat_tokens": {s: sum(len(r) for r, _ in chat[s]) for s in ("train", "heldout")},
                "text_windows": {s: len(texts[s]) for s in ("train", "heldout")},
                "seq_len": config.seq_len, "chat_seconds": round(chat_s, 1),
                "feature_seconds": round(time.monotonic() - t1, 1),
                "heldout_prompts": held_prompts[:len(chat["heldout"])], "aux_layers": aux_layers}
    atomic_write_json(data_dir / "eagle_manifest.json", manifest, durable=True)
    caches["manifest"] = manifest
    return caches
