"""The distillation loop: teacher (no gradients) -> KL at temperature tau -> AdamW on the draft's layers.

Knowledge distillation (Hinton, Vinyals & Dean 2015) of a small draft for speculative decoding (DistillSpec,
Zhou et al. 2024): on real text, minimise ``tau^2 * KL(p_target^tau || p_draft^tau)`` per token, where
``p^tau = softmax(logits / tau)``. DistillSpec finds forward KL on fixed data a solid default; it optimises
what greedy acceptance needs (the draft's argmax following the target's).

Output directory layout (``out``)::

    config.json, model.safetensors, generation_config.json, tokenizer*   the final draft (ModelSpec(source=out))
    distill_config.json          the run's configuration (checked on --resume)
    data/                        the token streams (train.npy, heldout.npy) and their manifest
    checkpoints/LATEST           name of the newest complete checkpoint
    checkpoints/step-000050/     draft weights (HF layout) + trainer_state.json/.safetensors (optimizer, step, clock,
                                 losses, RNG: see :mod:`toolkit.distill.checkpoints`; nothing is pickled)
    eval_before.json             held-out metrics of the untrained draft
    train_log.jsonl              one line per step: step, loss, lr, tokens/s
    metrics.json, report.md      before vs after: top-1 agreement, KL, alpha, tokens per round

Every checkpoint and result is written to a temporary sibling, fsynced and renamed into place (``os.replace``), so
an interrupted or killed run never leaves a half-written checkpoint or a half-applied step, and ``--resume``
restarts at the saved step with the same weights, optimizer moments, data position (batches are a pure function of
the step) and training clock; the training log is cut back to that step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.distill.checkpoints import (
    deferred_interrupts,
    latest_checkpoint,
    load_state,
    trim_log,
)
from toolkit.distill.config import DistillConfig
from toolkit.distill.data import BlockSampler, heldout_windows, load_streams
from toolkit.distill.draft import build_draft, check_target, set_trainable
from toolkit.distill.evaluate import evaluate, kd_loss
from toolkit.distill.outputs import (
    FINAL_MARKER,
    check_out,
    check_resume,
    markdown,
    prepare_out,
    save_checkpoint,
    save_final,
)
from toolkit.dtypes import torch_dtype
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ schedule
def learning_rate(step: int, total: int, peak: float, warmup: int, min_ratio: float,
                  time_fraction: float = 0.0) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay from ``peak`` to ``min_ratio * peak``.

    Progress is the larger of the step fraction ``(step - warmup) / (total - warmup)`` and ``time_fraction``
    (training time used / ``max_minutes``, 0 without a time budget), so the schedule ends with whichever budget
    binds first. Without a time budget the learning rate is a pure function of the step.
    """
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------------ the run
def _load_target(config: DistillConfig, device: torch.device, dtype: torch.dtype):
    from toolkit.recipe import ModelSpec
    from toolkit.session import SHARED_POOL

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return SHARED_POOL.get(ModelSpec(source=config.target, precision=precision, device=device.type), "target")


@dataclass
class _Run:
    """Everything one distillation run holds: fixed setup (models, data, schedule) and the training state."""

    config: DistillConfig
    out: Path
    device: torch.device
    precision: str
    autocast_dtype: torch.dtype | None
    target: torch.nn.Module
    tokenizer: object
    target_layers: int
    sources: list[int] | None
    batch_size: int = 0
    seq_len: int = 0
    total_steps: int = 0
    warmup: int = 0
    sampler: BlockSampler | None = None
    windows: torch.Tensor | None = None
    prompts: torch.Tensor | None = None
    manifest: dict = field(default_factory=dict)
    draft: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    trainable: list = field(default_factory=list)
    step: int = 0
    elapsed: float = 0.0
    losses: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    before: dict = field(default_factory=dict)
    stopped_by: str = "tokens"
    session_tokens: int = 0
    session_wall_s: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def evaluate(self) -> dict:
        """Held-out metrics of the current draft (see :func:`toolkit.distill.evaluate.evaluate`)."""
        c = self.config
        return evaluate(self.target, self.draft, self.windows, self.prompts, c.eval_new_tokens, c.eval_k,
                        self.autocast_dtype)

    def snapshot(self) -> dict:
        """The trainer state a checkpoint stores (with the draft's weights next to it)."""
        cuda = self.device.type == "cuda"
        return {"step": self.step, "elapsed_s": self.elapsed, "losses": self.losses,
                "optimizer": self.optimizer.state_dict(), "tokens_per_step": self.tokens_per_step,
                "total_steps": self.total_steps,
                "data_position": {"epoch_offset": self.sampler.position(self.step), "blocks": self.sampler.num_blocks},
                "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(self.device) if cuda else None}

    def save(self) -> Path:
        return save_checkpoint(self.out, self.draft, self.tokenizer, self.snapshot())


def _start(config: DistillConfig, target_model, tokenizer) -> _Run:
    """Check ``out`` and ``--resume`` (touching nothing), load the teacher; returns a run without data or draft."""
    from toolkit.models import resolve_device

    device = resolve_device(config.device)
    precision = config.precision if config.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch_dtype(precision)
    check_out(config)  # fail fast on bad input, before loading anything or touching the output directory
    if config.resume:
        check_resume(config, config.out)
    if target_model is None:
        target_model, tokenizer = _load_target(config, device, dtype)
    else:
        device = next(target_model.parameters()).device
    target_layers = check_target(target_model, config.layers)
    sources = config.init_layers(target_layers)
    target_model.eval()
    target_model.requires_grad_(False)
    return _Run(config, config.out, device, precision, None if dtype == torch.float32 else dtype, target_model,
                tokenizer, target_layers, sources)


def _load_data(run: _Run) -> None:
    """Batch geometry, schedule length, token streams, the sampler and the held-out windows / prompts."""
    config, cuda = run.config, run.device.type == "cuda"
    run.batch_size = config.batch_size or (32 if cuda else 4)
    run.seq_len = config.seq_len or (512 if cuda else 256)
    run.total_steps = math.ceil(config.tokens / run.tokens_per_step)
    run.warmup = (config.warmup_steps if config.warmup_steps is not None
                  else min(100, max(1, run.total_steps // 20)))
    atomic_write_json(run.out / FINAL_MARKER, config.to_dict(), durable=True)
    streams, run.manifest = load_streams(config.data, config.heldout_fraction, run.tokenizer, run.out / "data")
    run.sampler = BlockSampler(streams["train"], run.seq_len, run.batch_size, config.seed)
    run.windows = heldout_windows(streams["heldout"], run.seq_len, config.eval_windows)
    run.prompts = heldout_windows(streams["heldout"], config.eval_prompt_len, config.eval_prompts)


def _restore(run: _Run, checkpoint: Path | None) -> dict:
    """Build the draft (fresh, or from ``checkpoint``: weights from safetensors only, state from JSON +
    safetensors) and evaluate it before training when not done yet; returns the saved trainer state."""
    config = run.config
    if checkpoint is not None:
        from transformers import AutoModelForCausalLM

        state = load_state(checkpoint)
        try:  # safetensors only: a pytorch_model.bin (a pickle) in a checkpoint is never read
            run.draft = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                             use_safetensors=True).to(run.device)
        except (OSError, ValueError) as exc:
            raise ConfigError("resume", f"{checkpoint} holds no readable draft weights (config.json + "
                              f"model.safetensors): {exc}") from exc
        set_trainable(run.draft, config.freeze_embeddings)
        run.resumed_from = state["step"]
        log.info("resuming %s from step %d (%s)", run.out, run.resumed_from, checkpoint)
    else:
        run.draft = build_draft(run.target, config.layers, run.sources, freeze_embeddings=config.freeze_embeddings,
                                seed=config.seed)
        state = {"step": 0, "elapsed_s": 0.0, "losses": [], "optimizer": None}
    if config.resume:  # steps logged after the checkpoint (and a line a kill -9 cut short) are redone
        trim_log(run.out / "train_log.jsonl", state["step"])
    before_path = run.out / "eval_before.json"
    if before_path.is_file():
        run.before = json.loads(before_path.read_text())
    else:
        if state["step"] != 0:
            raise ConfigError("resume", f"{run.out} has a checkpoint but no eval_before.json; start over with --force")
        run.before = run.evaluate()
        atomic_write_json(before_path, run.before, durable=True)
    return state


def _make_optimizer(run: _Run, state: dict) -> None:
    """AdamW over the draft's trainable weights, its moments and the RNG states restored from ``state``."""
    config = run.config
    run.trainable = [p for p in run.draft.parameters() if p.requires_grad]
    run.optimizer = torch.optim.AdamW(run.trainable, lr=config.lr, weight_decay=config.weight_decay,
                                      betas=(0.9, 0.95), fused=run.device.type == "cuda")
    if state["optimizer"] is not None:
        run.optimizer.load_state_dict(state["optimizer"])
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
        if run.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], run.device)
    run.step, run.elapsed, run.losses = state["step"], state["elapsed_s"], list(state["losses"])


def _train_step(run: _Run, budget_s: float) -> tuple[float, float, float]:
    """One optimizer step on batch ``run.step``; returns ``(loss in nats/token, lr, seconds)``. The update and its
    bookkeeping are applied together (Ctrl-C is held until both are done).

    Raises:
        FloatingPointError: the loss is not finite.
    """
    config, device, autocast_dtype = run.config, run.device, run.autocast_dtype
    t0 = time.perf_counter()
    batch = run.sampler.batch(run.step).to(device)
    lr = learning_rate(run.step, run.total_steps, config.lr, run.warmup, config.min_lr_ratio,
                       run.elapsed / budget_s if math.isfinite(budget_s) else 0.0)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        teacher_logits = run.target(input_ids=batch, use_cache=False).logits
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        student_logits = run.draft(input_ids=batch, use_cache=False).logits
    loss = kd_loss(teacher_logits, student_logits, config.temperature)
    del teacher_logits
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    del student_logits
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.trainable, config.grad_clip)
    with deferred_interrupts():
        run.optimizer.step()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"distillation loss became {loss_value} at step {run.step}; lower --lr")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        run.step += 1
        run.elapsed += dt
        run.losses.append(loss_value)
        run.session_tokens += run.tokens_per_step
    return loss_value, lr, dt


def _train(run: _Run, callback, progress: bool) -> None:
    """The training loop with its checkpoints. Ctrl-C saves a checkpoint at the last completed step and re-raises;
    SIGTERM stops after the current step (``run.stopped_by = "sigterm"``)."""
    from tqdm.auto import tqdm

    config, out = run.config, run.out
    budget_s = config.max_minutes * 60 if config.max_minutes is not None else math.inf
    stop = {"term": False}
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.__setitem__("term", True))
    bar = tqdm(total=run.total_steps * run.tokens_per_step, initial=run.step * run.tokens_per_step, unit="tok",
               unit_scale=True, desc=f"distill {config.layers}L", dynamic_ncols=True, disable=not progress,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    last_ckpt_time, last_ckpt_step = time.monotonic(), run.step
    session_start = time.perf_counter()
    try:
        with open(out / "train_log.jsonl", "a") as log_file:
            if run.resumed_from is not None:
                log_file.write(json.dumps({"event": "resume", "step": run.step}) + "\n")
            while run.step < run.total_steps:
                if run.elapsed >= budget_s or stop["term"]:
                    run.stopped_by = "max_minutes" if run.elapsed >= budget_s else "sigterm"
                    break
                loss_value, lr, dt = _train_step(run, budget_s)
                bar.update(run.tokens_per_step)
                bar.set_postfix(loss=f"{loss_value:.3f}", step=run.step, refresh=False)
                log_file.write(json.dumps({"step": run.step, "loss": round(loss_value, 5), "lr": lr,
                                           "tokens_per_s": round(run.tokens_per_step / dt, 1),
                                           "elapsed_s": round(run.elapsed, 2)}) + "\n")
                log_file.flush()
                if callback is not None:
                    callback(run.step, loss_value)
                due = (run.step - last_ckpt_step >= config.checkpoint_every
                       or time.monotonic() - last_ckpt_time >= config.checkpoint_minutes * 60)
                if due and run.step < run.total_steps:
                    run.save()
                    last_ckpt_time, last_ckpt_step = time.monotonic(), run.step
    except KeyboardInterrupt:
        bar.close()
        if run.step > last_ckpt_step or latest_checkpoint(out) is None:
            run.save()
        log.warning("interrupted at step %d; checkpoint saved, continue with --resume", run.step)
        raise
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    run.session_wall_s = time.perf_counter() - session_start  # this process's training time, checkpoints included


def _metrics(run: _Run, after: dict) -> dict:
    """The metrics dict of a finished run (also ``metrics.json``)."""
    config, draft, losses, step, elapsed = run.config, run.draft, run.losses, run.step, run.elapsed
    head, tail = losses[:10], losses[-10:]
    tokens = step * run.tokens_per_step
    return {
        "config": config.to_dict(),
        "draft": {"layers": config.layers, "target_layers": run.target_layers, "init_layers": run.sources,
                  "architecture": type(draft).__name__, "parameters": sum(p.numel() for p in draft.parameters()),
                  "trainable_parameters": sum(p.numel() for p in run.trainable)},
        "training": {"steps": step, "total_steps": run.total_steps, "tokens": tokens, "batch_size": run.batch_size,
                     "seq_len": run.seq_len, "warmup_steps": run.warmup, "seconds": elapsed, "minutes": elapsed / 60,
                     "tokens_per_second": tokens / elapsed if elapsed else 0.0,
                     "session_tokens_per_second": run.session_tokens / max(1e-9, run.session_wall_s),
                     "first_loss": sum(head) / len(head) if head else float("nan"),
                     "last_loss": sum(tail) / len(tail) if tail else float("nan"),
                     "losses": losses, "stopped_by": run.stopped_by, "resumed_from_step": run.resumed_from,
                     "device": str(run.device), "precision": run.precision, "threads": torch.get_num_threads()},
        "data": run.manifest,
        "eval": {"windows": int(run.windows.shape[0]), "seq_len": run.seq_len, "prompts": int(run.prompts.shape[0]),
                 "prompt_len": config.eval_prompt_len, "new_tokens": config.eval_new_tokens, "k": config.eval_k},
        "before": run.before,
        "after": after,
        "out": str(run.out),
    }


def distill(config: DistillConfig | None = None, *, target_model=None, tokenizer=None,
            callback: Callable[[int, float], None] | None = None, progress: bool = True, **overrides) -> dict:
    """Distill an N-layer draft from a target; returns the metrics dict also written to ``out/metrics.json``.

    Args:
        config: a :class:`DistillConfig`; ``overrides`` replace its fields (``distill(layers=2, out=...)``).
        target_model / tokenizer: an already loaded teacher (a ``*ForCausalLM``) and its tokenizer; when omitted the
            teacher is loaded from ``config.target`` through :func:`toolkit.models.load_model`.
        callback: called as ``callback(step, loss)`` after every optimizer step (``step`` = steps completed, loss in
            nats/token); raising ``KeyboardInterrupt`` from it interrupts the run like Ctrl-C.
        progress: show the tqdm bar (tokens, tokens/s, loss).

    Tensor shapes: batches ``(batch_size, seq_len)`` int64; logits ``(batch_size, seq_len, vocab)`` (fp32 for the
    loss). Memory is dominated by the two logit tensors: ``2 * batch_size * seq_len * vocab * 4`` bytes plus their
    softmax copies and gradient.

    Interruption: Ctrl-C (KeyboardInterrupt) or SIGTERM saves a checkpoint at the last completed step and re-raises
    (SIGTERM exits with status 143); ``resume=True`` continues from it with nothing lost. A kill -9 loses only the
    steps after the last checkpoint (every file is written to a temporary name, fsynced and renamed).

    Raises:
        ConfigError: a field is invalid — ``layers`` (N < 1 or N >= target layers), ``target`` (no LM head,
            quantized), ``out`` (exists without ``resume`` / ``force``), ``data`` (no usable text), ``tokenizer``
            (a target model without its tokenizer), ``resume`` (a checkpoint that is unreadable, in the old pickle
            format, or named by a ``LATEST`` pointing outside the run), or a field that differs from the run being
            resumed.
        ModelLoadError: the target cannot be loaded.
    """
    config = dataclasses.replace(config or DistillConfig(), **overrides)
    config.validate()
    if target_model is not None and tokenizer is None:
        raise ConfigError("tokenizer", "a target model passed in needs its tokenizer too")
    if config.threads:
        torch.set_num_threads(config.threads)
    run = _start(config, target_model, tokenizer)
    checkpoint = prepare_out(config)
    _load_data(run)
    _make_optimizer(run, _restore(run, checkpoint))
    _train(run, callback, progress)
    run.save()
    if run.stopped_by == "sigterm":
        log.warning("SIGTERM at step %d; checkpoint saved, continue with --resume", run.step)
        raise SystemExit(143)
    run.draft.eval()
    save_final(run.out, run.draft, run.tokenizer)
    metrics = _metrics(run, run.evaluate())
    atomic_write_json(run.out / "metrics.json", metrics, durable=True)
    atomic_write_text(run.out / "report.md", markdown(metrics), durable=True)
    return metrics
