"""Train an EAGLE head for a target (``toolkit draft eagle``): EAGLE-1 or EAGLE-3 layout (``variant``), reduced
draft vocabulary, EAGLE-3's training-time test.

``variant: eagle3`` trains the EAGLE-3 head instead: its step-1 input is three target layers' raw outputs (the
layers of :meth:`toolkit.eagle.head.HeadConfig.from_target`, cached as ``aux``), its loss is the token-level KL
only (no feature regression), and it trains its own LM head over the draft vocabulary; the result exports to the
speculators layout vLLM serves (``toolkit draft export-head``).

Recipe (Li et al. 2024 EAGLE; Li et al. 2025 EAGLE-3; Zhao et al. 2025 FR-Spec), measured here on SmolLM2:

* Features are the target's last-layer outputs *after* its final norm (SmolLM2's pre-norm features have massive
  activations: a raw regression is dominated by a few dimensions). The head predicts the next normed feature.
* Loss per position: a token-level loss — KL(target || head) over the draft vocabulary, with the target's
  distribution read from its own next feature through the frozen LM head — plus ``reg_weight`` x SmoothL1 of the
  feature error standardised per dimension.
* Training-time test: the head is unrolled ``ttt_steps`` draft steps; step s reads its own step s-1 output, and its
  attention sees the true-feature keys up to the chain's start plus its own earlier draft steps (the exact
  attention pattern of drafting), losses weighted ``ttt_decay ** (s-1)``.
* Held-out acceptance: on target-generated answers to held-out prompts, every position starts a greedy draft chain
  of ``eval_k`` steps; ``alpha[j]`` = P(draft j matches the target's argmax | drafts 1..j-1 matched) — exactly what
  the speculative decoder would accept greedily (inputs are the target's own tokens, which the accepted drafts are).

Outputs in ``out``: ``data/`` (feature caches, safetensors), ``checkpoints/step-N`` (atomic, durable, resumable,
never pickled: :mod:`toolkit.distill.checkpoints`), ``best/`` (the head with the highest held-out expected accepted
length), ``curve.json`` / ``curve.png`` (alpha per position vs training tokens), ``train_log.jsonl``.

The unrolled head, its loss and the held-out acceptance curve are in :mod:`toolkit.distill.eagle_loss`; the data
(chat answers, feature caches) in :mod:`toolkit.distill.eagle_data`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.checks import TOKENS_MAX, check_choice, check_float, check_int, check_seed, check_str_list
from toolkit.distill.checkpoints import (
    deferred_interrupts,
    latest_checkpoint,
    load_state,
    save_state,
    trim_log,
    write_checkpoint,
)
from toolkit.distill.eagle_data import expand_data, prepare_data  # noqa: F401 (expand_data: part of this API)
from toolkit.distill.eagle_init import build_head
from toolkit.distill.eagle_loss import (  # noqa: F401 (target_log_probs, ttt_mask, unroll: part of this API)
    alpha_curve,
    head_loss,
    input_key,
    target_log_probs,
    ttt_mask,
    unroll,
)
from toolkit.eagle.checkpoint import dense_weight, save_head
from toolkit.eagle.head import VARIANTS
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_png, recover_dir, replace_dir

log = logging.getLogger(__name__)

DEFAULT_DATA = ["/usr/lib/python3*/*.py", "/usr/share/common-licenses/*", "/usr/share/doc/*/README*",
                "/usr/share/doc/*/*.txt", "/usr/share/doc/*/*.md"]


@dataclass
class EagleTrainConfig:
    """A head-training run. Token counts are per window (``seq_len``); ``minutes`` bounds the training loop.

    Attributes:
        target: ``ModelSpec.source`` of the target; data precision ``target_precision`` (bf16 on CPU is fine).
        out: output directory. data: text globs (``.gz`` skipped). draft_vocab: size of the reduced vocabulary.
        text_windows / chat_prompts / chat_minutes / chat_new_tokens: corpus size and the self-generated answers.
        heldout_prompts: held-out chat prompts for the acceptance curve.
        ttt_steps / ttt_decay / reg_weight: the loss (see the module docstring).
        batch_size / seq_len / lr / warmup_steps / minutes: the optimisation; ``minutes`` = training wall time.
        eval_every_minutes / eval_k: held-out acceptance evaluation cadence and chain length.
    """

    target: str = "embedded"
    target_precision: str = "bf16"
    variant: str = "eagle1"
    out: str | Path = "results/eagle/head"
    data: list[str] = field(default_factory=lambda: list(DEFAULT_DATA))
    draft_vocab: int = 8192
    seq_len: int = 320
    text_windows: int = 320
    chat_prompts: int = 800
    chat_minutes: float = 8.0
    chat_new_tokens: int = 160
    chat_batch: int = 16
    heldout_prompts: int = 40
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    reg_weight: float = 0.1
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    minutes: float = 30.0
    eval_every_minutes: float = 3.0
    eval_k: int = 5
    seed: int = 0
    resume: bool = False
    force: bool = False
    autocast: bool = True

    def validate(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("target", "must be a model source: 'embedded', a local directory or a hub id")
        check_choice("target_precision", self.target_precision, ("fp32", "bf16"))
        check_choice("variant", self.variant, VARIANTS)
        self.data = check_str_list("data", self.data, "text files or globs")
        check_int("draft_vocab", self.draft_vocab, low=16, high=TOKENS_MAX)
        check_int("seq_len", self.seq_len, low=8, high=TOKENS_MAX)
        check_int("text_windows", self.text_windows, low=0, high=10**7)
        check_int("chat_prompts", self.chat_prompts, low=0, high=10**7)
        check_float("chat_minutes", self.chat_minutes, low=0.0)
        check_int("chat_new_tokens", self.chat_new_tokens, low=1, high=TOKENS_MAX)
        check_int("chat_batch", self.chat_batch, low=1, high=4096)
        check_int("heldout_prompts", self.heldout_prompts, low=1, high=10**6)
        check_int("ttt_steps", self.ttt_steps, low=1, high=8)
        check_float("ttt_decay", self.ttt_decay, low=0.0, high=1.0)
        check_float("reg_weight", self.reg_weight, low=0.0)
        check_int("batch_size", self.batch_size, low=1, high=65536)
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_int("warmup_steps", self.warmup_steps, low=0, high=10**9)
        check_float("minutes", self.minutes, low=0.0, low_open=True)
        check_float("eval_every_minutes", self.eval_every_minutes, low=0.0, low_open=True)
        check_int("eval_k", self.eval_k, low=1, high=16)
        check_seed("seed", self.seed)
        for name in ("resume", "force", "autocast"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.resume and self.force:
            raise ConfigError("resume", "--resume and --force are mutually exclusive")
        self.out = Path(self.out).expanduser()


# ------------------------------------------------------------------------------------------------ training
def _plot(curve: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["tokens"] for c in curve]
    for j in range(len(curve[0]["alpha"])):
        ax.plot(xs, [c["alpha"][j] for c in curve], marker="o", label=f"alpha{j + 1}")
    ax.set_xlabel("training tokens (positions x unrolled steps not counted)")
    ax.set_ylabel("held-out acceptance (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


class _HeadRun:
    """One head-training run: the head and its optimizer, the feature caches, and ``state`` (step, training clock,
    tokens, the held-out curve, the best tau) — what a checkpoint stores, together with the best head so far."""

    def __init__(self, config: EagleTrainConfig, target, data: dict):
        self.config, self.out, self.data = config, config.out, data
        train = data["train"]
        vocab = target.config.vocab_size
        counts = torch.bincount(train["tokens"][train["mask"]], minlength=vocab).double()
        chat = train["kind"] == 1
        counts += 3 * torch.bincount(train["tokens"][chat][train["mask"][chat]], minlength=vocab).double()
        self.device = next(target.parameters()).device  # the head trains where the target runs (a GPU: there)
        self.head = build_head(target, config.draft_vocab, counts, config.seed, config.variant).to(self.device)
        self.head.draft_to_target = self.head.draft_to_target.to(self.device)
        self.full_lm = dense_weight(target.get_output_embeddings()).float().to(self.device)
        self.target_lm = self.full_lm[self.head.draft_to_target]  # the target's law over the draft vocabulary
        self.inputs = input_key(self.head)
        self.std = train["features"][:64][train["mask"][:64]].float().std(0).clamp_min(1e-3).to(self.device)
        self.trainable = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.state = {"step": 0, "elapsed_s": 0.0, "tokens": 0, "curve": [], "best_tau": 0.0}

    def resume(self) -> None:
        """Continue from the latest checkpoint, if any: weights, optimizer, state; ``best/``, ``curve.json`` and the
        log put back in line with it. Raises ConfigError (``resume``) for an unreadable or escaping checkpoint."""
        recover_dir(self.out / "best")
        for stale in self.out.glob(".best.*"):
            shutil.rmtree(stale, ignore_errors=True)
        checkpoint = latest_checkpoint(self.out)
        if checkpoint is not None:
            saved = load_state(checkpoint)
            try:
                self.head.load_state_dict(saved["head"])
                self.head.draft_to_target = saved["draft_to_target"].to(self.device)
                self.optimizer.load_state_dict(saved["optimizer"])
                self.state = saved["state"]
            except (KeyError, RuntimeError, ValueError, TypeError) as exc:
                raise ConfigError("resume", f"{checkpoint} does not fit this run ({exc}); start over with --force")
            self.publish(checkpoint, best=True)
            log.info("resumed at step %d", self.state["step"])
        trim_log(self.out / "train_log.jsonl", self.state["step"])

    def evaluate(self) -> bool:
        """Append a held-out point (chat and text alpha) to the curve; returns whether tau is the best so far."""
        config, state, held, head = self.config, self.state, self.data["heldout"], self.head
        head.eval()
        chat_alpha = alpha_curve(head, held, config.eval_k, self.full_lm, kinds=(1,))
        text_alpha = alpha_curve(head, held, config.eval_k, self.full_lm, kinds=(0,))
        head.train()
        point = {"step": state["step"], "tokens": state["tokens"], "minutes": state["elapsed_s"] / 60,
                 "alpha": chat_alpha["alpha"], "tau": chat_alpha["tau"], "chains": chat_alpha["chains"],
                 "text_alpha": text_alpha["alpha"], "text_tau": text_alpha["tau"]}
        state["curve"].append(point)
        log.info("eval step %d tokens %d: alpha %s tau %.3f | text alpha %s", state["step"], state["tokens"],
                 [round(a, 3) for a in point["alpha"]], point["tau"], [round(a, 3) for a in point["text_alpha"]])
        if not point["tau"] > state["best_tau"]:  # (a NaN tau, no chains, is never the best)
            return False
        state["best_tau"], state["best_step"] = point["tau"], state["step"]
        return True

    def checkpoint(self, improved: bool) -> None:
        """Save a checkpoint (head, optimizer, state and the best head: this one when ``improved``, else the previous
        checkpoint's), then publish ``curve.json`` / ``curve.png`` / ``best/`` from it."""
        previous = latest_checkpoint(self.out)
        snapshot = {"head": self.head.state_dict(), "draft_to_target": self.head.draft_to_target,
                    "optimizer": self.optimizer.state_dict(), "state": self.state, "step": self.state["step"]}

        def write(tmp: Path) -> None:
            save_head(self.head, tmp)
            save_state(tmp, snapshot)
            if improved:
                save_head(self.head, tmp / "best", dtype=torch.bfloat16)
            elif previous is not None and (previous / "best").is_dir():
                shutil.copytree(previous / "best", tmp / "best")

        self.publish(write_checkpoint(self.out, self.state["step"], write), best=improved)

    def publish(self, checkpoint: Path, best: bool) -> None:
        """The results outside ``checkpoints/``, from ``checkpoint``: the curve, and with ``best`` the ``best/``
        head (copied to a temporary directory, swapped in by :func:`toolkit.io.replace_dir`)."""
        if self.state["curve"]:
            atomic_write_json(self.out / "curve.json", self.state["curve"], durable=True)
            _plot(self.state["curve"], self.out / "curve.png")
        if best and (checkpoint / "best").is_dir():
            tmp = Path(tempfile.mkdtemp(dir=self.out, prefix=".best."))
            shutil.copytree(checkpoint / "best", tmp, dirs_exist_ok=True)
            replace_dir(tmp, self.out / "best")

    def step(self, generator: torch.Generator, weights: list[float]) -> dict:
        """One optimizer step on a random batch; returns the log entry. Update and bookkeeping are applied together
        (Ctrl-C is held until both are done)."""
        config, state, train = self.config, self.state, self.data["train"]
        t0 = time.perf_counter()
        idx = torch.randint(0, train["tokens"].shape[0], (config.batch_size,), generator=generator)
        f, t, m = (train[k][idx].to(self.device) for k in ("features", "tokens", "mask"))
        f = f.float()
        inputs = train[self.inputs][idx].to(self.device).float() if self.inputs != "features" else None
        valid = m[:, 1:].float()
        progress_frac = state["elapsed_s"] / (config.minutes * 60)
        lr = config.lr * min(1.0, (state["step"] + 1) / config.warmup_steps) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_frac)))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, parts = head_loss(self.head, f, t, valid, weights, config.reg_weight, self.std, config.autocast,
                                inputs, self.target_lm)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        with deferred_interrupts():
            self.optimizer.step()
            dt = time.perf_counter() - t0
            state["step"] += 1
            state["elapsed_s"] += dt
            state["tokens"] += int(valid.sum())
        return {"step": state["step"], "loss": round(float(loss.detach()), 4), "kl": parts, "lr": lr, "tokens": state["tokens"],
                "tokens_per_s": round(valid.sum().item() / dt, 1), "elapsed_s": round(state["elapsed_s"], 1)}

    def train(self, progress: bool) -> str:
        """Train until ``minutes`` of training time (summed over resumes) or SIGTERM; evaluate and checkpoint every
        ``eval_every_minutes``. Returns what stopped it: ``minutes`` or ``sigterm``."""
        config, state = self.config, self.state
        stop = {"term": False}
        previous = signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("term", True)) \
            if sys.gettrace() is None else None
        if not state["curve"]:
            self.checkpoint(self.evaluate())
        generator = torch.Generator().manual_seed(config.seed + state["step"])
        last_eval = state["elapsed_s"]
        weights = [config.ttt_decay ** s for s in range(config.ttt_steps)]
        self.head.train()
        try:
            with open(self.out / "train_log.jsonl", "a") as log_file:
                while state["elapsed_s"] < config.minutes * 60:
                    if stop["term"]:
                        return "sigterm"
                    entry = self.step(generator, weights)
                    log_file.write(json.dumps(entry) + "\n")
                    log_file.flush()
                    if progress and state["step"] % 10 == 0:
                        print(f"step {state['step']} tokens {state['tokens']} loss {entry['loss']:.3f} kl "
                              f"{entry['kl']} {entry['tokens_per_s']:.0f} tok/s {state['elapsed_s'] / 60:.1f} min",
                              file=sys.stderr, flush=True)
                    if state["elapsed_s"] - last_eval >= config.eval_every_minutes * 60:
                        self.checkpoint(self.evaluate())
                        last_eval = state["elapsed_s"]
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return "minutes"

    def summary(self, stopped_by: str) -> dict:
        state, manifest = self.state, self.data["manifest"]
        return {"stopped_by": stopped_by, "steps": state["step"], "tokens": state["tokens"],
                "minutes": state["elapsed_s"] / 60, "best_step": state.get("best_step"),
                "best_tau": state["best_tau"], "curve": state["curve"],
                "data": manifest | {"heldout_prompts": len(manifest.get("heldout_prompts", []))},
                "config": dataclasses.asdict(self.config) | {"out": str(self.out)}}


def train_head(config: EagleTrainConfig, target=None, tokenizer=None, progress: bool = True) -> dict:
    """Run (or resume) a head-training run; returns the final summary also written to ``out/summary.json``.

    Every checkpoint (head, optimizer, state, best head so far) is written atomically and durably and read back
    without unpickling (:mod:`toolkit.distill.checkpoints`); ``best/``, ``curve.json`` and ``curve.png`` are
    published from the checkpoint, so a kill -9 at any point followed by ``resume`` loses only the steps after the
    last checkpoint.

    Raises:
        ConfigError: a field is invalid (named), ``out`` exists without ``resume`` / ``force``, ``force`` on a
            directory the toolkit did not create (:mod:`toolkit.outdirs`), ``resume`` (an unreadable checkpoint,
            one in the old pickle format, or a ``LATEST`` pointing outside the run), ``data`` (a feature cache this
            toolkit did not write).
    """
    from toolkit.outdirs import check_removable, make_output_dir, remove_output_dir

    config.validate()
    out: Path = config.out
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (config.resume or config.force):
        raise ConfigError("out", f"{out} exists; pass --resume to continue or --force to start over")
    if config.force:
        check_removable(out, "out")
    if target is None:
        from toolkit.models import load_model
        from toolkit.recipe import ModelSpec

        target, tokenizer = load_model(ModelSpec(source=config.target, precision=config.target_precision),
                                       field="target")
    if config.draft_vocab > target.config.vocab_size:  # before the (long) data preparation
        raise ConfigError("draft_vocab", f"must be <= the target's vocab_size {target.config.vocab_size}, got "
                          f"{config.draft_vocab}")
    if config.force:
        remove_output_dir(out, "out")
    make_output_dir(out, "out")
    atomic_write_json(out / "config.json.run", dataclasses.asdict(config) | {"out": str(out)}, durable=True)
    aux_layers = None
    if config.variant == "eagle3":
        from toolkit.eagle.head import HeadConfig

        aux_layers = HeadConfig.from_target(target.config, "eagle3").feature_layers
    run = _HeadRun(config, target, prepare_data(config, target, tokenizer, aux_layers))
    if config.resume:
        run.resume()
    stopped_by = run.train(progress)
    run.checkpoint(run.evaluate())
    summary = run.summary(stopped_by)
    atomic_write_json(out / "summary.json", summary, durable=True)
    return summary
