"""Configuration of a draft-distillation run (``toolkit draft distill``).

Every field is checked by :meth:`DistillConfig.validate`; a bad value raises :class:`toolkit.errors.ConfigError`
naming the field (``layers``, ``out``, ``temperature`` ...) and, where the set is closed, the allowed values.
Checks that need the target (``layers`` < target layers, the target has an LM head) run after it is loaded.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checks import TOKENS_MAX, check_choice, check_float, check_int, check_seed
from toolkit.errors import ConfigError

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
#: the largest training budget (10^13 tokens: far beyond any run this toolkit is for)
MAX_TOKENS = 10**13
DEVICES = ("auto", "cpu", "cuda")
INIT_CHOICES = ("spaced", "first", "last", "random")

#: fields whose value must match between a checkpoint and a resumed run (anything else may change, e.g. eval sizes)
RESUME_KEYS = ("target", "layers", "tokens", "temperature", "init", "freeze_embeddings", "batch_size", "seq_len",
               "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "seed", "data", "precision")


def parse_tokens(value: int | str, name: str = "tokens") -> int:
    """``2000000``, ``"2M"``, ``"500k"``, ``"1.5G"`` -> int tokens. Raises :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(name, f"must be a token count, got {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", str(value))
    if not match:
        raise ConfigError(name, f"must be a token count like 200000, 500k or 2M, got {value!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()]
    count = float(match.group(1)) * scale
    if count > MAX_TOKENS:
        raise ConfigError(name, f"must be at most {MAX_TOKENS:.0e} tokens, got {value!r}")
    return int(count)


@dataclass
class DistillConfig:
    """What to distill into what, on which data, for how long.

    Attributes:
        target: ``ModelSpec.source`` of the teacher: ``embedded``, a local HF directory, a ``.gguf`` file or a hub id.
        layers: N, decoder layers of the draft; ``1 <= N < target layers``.
        tokens: training budget in tokens (int or ``"2M"``); steps = ceil(tokens / (batch_size * seq_len)). The
            learning-rate schedule (linear warmup, cosine decay to ``min_lr_ratio * lr``) spans these steps.
        out: output directory; becomes a standard HF model directory (config.json, model.safetensors, tokenizer).
        data: training text: files, directories (read recursively), globs, or ``hub:NAME[:CONFIG]`` for a hub dataset
            (only when the hub is reachable). Empty = Python standard-library sources + /usr/share/common-licenses.
        temperature: KD temperature tau (> 0); the loss is tau^2 * KL(softmax(z_t/tau) || softmax(z_d/tau)).
        resume: continue an interrupted run from the latest checkpoint in ``out``.
        force: delete an existing ``out`` and start over.
        init: how the N draft layers start: ``spaced`` (target layers evenly spaced from first to last, default),
            ``first`` (layers 0..N-1), ``last`` (the last N), ``random`` (the config's initializer), or an explicit
            comma list of target layer indices such as ``"0,29"``.
        freeze_embeddings: keep the embedding and LM head (copied from the target) frozen (default, see
            :func:`toolkit.distill.draft.build_draft` for why).
        batch_size / seq_len: sequences per step and tokens per sequence; ``None`` = device default (CPU 4 x 256,
            CUDA 32 x 512).
        lr / min_lr_ratio / warmup_steps / weight_decay / grad_clip: AdamW and its schedule.
        precision: ``auto`` (fp32 on CPU; bf16 teacher + bf16 autocast with fp32 draft master weights on CUDA),
            ``fp32``, ``bf16``, ``fp16``.
        device: ``auto`` / ``cpu`` / ``cuda``.
        max_minutes: stop training after this many minutes of training time (summed over resumes); ``None`` = off.
            With a time budget the cosine schedule also follows the time used (see ``trainer.learning_rate``).
        checkpoint_every: save a checkpoint every this many steps; ``checkpoint_minutes`` also every this many
            minutes, whichever comes first.
        heldout_fraction: fraction of data files held out (chosen deterministically by a hash of the file name).
        eval_windows / eval_prompts / eval_prompt_len / eval_new_tokens / eval_k: held-out evaluation sizes:
            windows of ``seq_len`` tokens for top-1 agreement and KL; prompts of ``eval_prompt_len`` tokens from which
            the speculative decoder (greedy, EOS ignored, constant K = ``eval_k``) generates ``eval_new_tokens``.
        seed: seeds the data order and the random layer init.
        threads: torch CPU threads (``None`` = torch's default).
    """

    target: str = "embedded"
    layers: int = 2
    tokens: int | str = 1_000_000
    out: str | Path = "results/distill/draft"
    data: list[str] = field(default_factory=list)
    temperature: float = 1.0
    resume: bool = False
    force: bool = False
    init: str = "spaced"
    freeze_embeddings: bool = True
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: str = "auto"
    device: str = "auto"
    max_minutes: float | None = None
    checkpoint_every: int = 50
    checkpoint_minutes: float = 5.0
    heldout_fraction: float = 0.05
    eval_windows: int = 16
    eval_prompts: int = 8
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64
    eval_k: int = 4
    seed: int = 0
    threads: int | None = None

    def validate(self) -> None:
        """Check every field that does not need the target. Raises :class:`ConfigError` naming the field."""
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("target", "must be a model source: 'embedded', a local directory, a .gguf file or a "
                              "hub id")
        check_int("layers", self.layers, low=1, high=1024)
        self.tokens = parse_tokens(self.tokens)
        check_int("tokens", self.tokens, low=1, high=MAX_TOKENS)
        if self.out is None or str(self.out) == "":
            raise ConfigError("out", "must be an output directory path")
        self.out = Path(self.out).expanduser()
        if isinstance(self.data, str):
            self.data = [self.data]
        if not isinstance(self.data, (list, tuple)) or not all(isinstance(d, str) and d for d in self.data):
            raise ConfigError("data", "must be a list of files, directories, globs or hub:NAME[:CONFIG] entries")
        self.data = list(self.data)
        check_float("temperature", self.temperature, low=1e-3, high=1000.0)  # logits / tau stays finite
        if self.resume and self.force:
            raise ConfigError("resume", "--resume and --force are mutually exclusive (continue a run, or start over)")
        if self.init not in INIT_CHOICES and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", str(self.init)):
            raise ConfigError("init", f"unknown value {self.init!r}", [*INIT_CHOICES, "comma list of layer indices"])
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, low=1, high=65536)
        if self.seq_len is not None:
            check_int("seq_len", self.seq_len, low=2, high=TOKENS_MAX)
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, low=0, high=10**9)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("grad_clip", self.grad_clip, low=0.0)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("device", self.device, DEVICES)
        if self.max_minutes is not None:
            check_float("max_minutes", self.max_minutes, low=0.0, low_open=True)
        check_int("checkpoint_every", self.checkpoint_every, low=1, high=10**9)
        check_float("checkpoint_minutes", self.checkpoint_minutes, low=0.0, low_open=True)
        check_float("heldout_fraction", self.heldout_fraction, low=0.0, high=0.5, low_open=True)
        check_int("eval_windows", self.eval_windows, low=0, high=100_000)
        check_int("eval_prompts", self.eval_prompts, low=0, high=100_000)
        check_int("eval_prompt_len", self.eval_prompt_len, low=1, high=TOKENS_MAX)
        check_int("eval_new_tokens", self.eval_new_tokens, low=2, high=TOKENS_MAX)
        check_int("eval_k", self.eval_k, low=1, high=64)
        check_seed("seed", self.seed)
        if self.threads is not None:
            check_int("threads", self.threads, low=1, high=4096)

    def init_layers(self, target_layers: int) -> list[int] | None:
        """Target layer indices the draft layers start from (``None`` = random init).

        ``spaced`` picks ``round(i * (L - 1) / (N - 1))`` for i = 0..N-1 (always the first and the last layer: the
        embedding-facing and the LM-head-facing layers are the least replaceable); N = 1 picks the last layer.
        Raises :class:`ConfigError` (field ``init``) for an explicit list of the wrong length or out of range.
        """
        n, total = self.layers, target_layers
        if self.init == "random":
            return None
        if self.init == "first":
            return list(range(n))
        if self.init == "last":
            return list(range(total - n, total))
        if self.init == "spaced":
            if n == 1:
                return [total - 1]
            return [round(i * (total - 1) / (n - 1)) for i in range(n)]
        indices = [int(part) for part in str(self.init).split(",")]
        if len(indices) != n:
            raise ConfigError("init", f"lists {len(indices)} layer indices but layers={n}")
        bad = [i for i in indices if not 0 <= i < total]
        if bad:
            raise ConfigError("init", f"layer index {bad[0]} is out of range for a {total}-layer target",
                              [f"0..{total - 1}"])
        return indices

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["out"] = str(self.out)
        return data
