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
    checkpoints/step-000050/     draft weights (HF layout) + trainer_state.pt (optimizer, step, clock, losses, RNG)
    eval_before.json             held-out metrics of the untrained draft
    train_log.jsonl              one line per step: step, loss, lr, tokens/s
    metrics.json, report.md      before vs after: top-1 agreement, KL, alpha, tokens per round

Every checkpoint and result is written to a temporary sibling and renamed into place (``os.replace``), so an
interrupted run never leaves a half-written checkpoint, and ``--resume`` restarts at the saved step with the same
weights, optimizer moments, data position (batches are a pure function of the step) and training clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from toolkit.distill.config import RESUME_KEYS, DistillConfig
from toolkit.distill.data import BlockSampler, heldout_windows, load_streams
from toolkit.distill.draft import build_draft, check_target, set_trainable
from toolkit.distill.evaluate import evaluate, kd_loss
from toolkit.dtypes import torch_dtype
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

_FINAL_MARKER = "distill_config.json"


# ------------------------------------------------------------------------------------------------ checkpoints
def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint directory under ``out/checkpoints`` (named by ``LATEST``), or None."""
    pointer = out / "checkpoints" / "LATEST"
    if not pointer.is_file():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def save_checkpoint(out: Path, draft, tokenizer, state: dict) -> Path:
    """Write ``checkpoints/step-NNNNNN`` atomically (temp dir + ``os.replace``), point ``LATEST`` at it, then delete
    older checkpoints. ``state`` holds the optimizer state dict, step, clock, losses and RNG states."""

    def write(tmp: Path) -> None:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(state, tmp / "trainer_state.pt")

    return write_checkpoint(out, state["step"], write)


def write_checkpoint(out: Path, step: int, write) -> Path:
    """``out/checkpoints/step-NNNNNN`` filled by ``write(tmp_dir)`` in a temporary directory renamed into place, then
    ``LATEST`` pointed at it and older checkpoints deleted: an interrupted save leaves the previous one intact.
    Shared by draft distillation and EAGLE-head training."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "LATEST", name + "\n")
    for old in root.iterdir():
        if old.is_dir() and old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_final(out: Path, draft, tokenizer) -> None:
    """Write the draft as a standard HF model directory into ``out`` (files renamed in one by one from a temp dir;
    ``config.json`` last, so a directory with ``config.json`` always has its weights)."""
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".final."))
    try:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        names.sort(key=lambda n: n == "config.json")
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
def _check_out(config: DistillConfig) -> None:
    """Raise :class:`ConfigError` (field ``out``) when ``out`` is a file, a non-empty directory without
    --resume / --force, or, with --force, a directory the toolkit did not create (:mod:`toolkit.outdirs`). Touches
    nothing."""
    from toolkit.outdirs import check_removable

    out: Path = config.out
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (config.force or config.resume):
        raise ConfigError("out", f"{out} already exists; pass --resume to continue that run or --force to "
                          "delete it and start over", ["--resume", "--force", "a new directory"])
    if config.force:
        check_removable(out, "out")


def _prepare_out(config: DistillConfig) -> Path | None:
    """Apply --force (delete a directory the toolkit created) / --resume to ``config.out``, which is then a marked
    toolkit output directory; returns the checkpoint to resume from (or None)."""
    from toolkit.outdirs import make_output_dir, remove_output_dir

    _check_out(config)
    out: Path = config.out
    if config.force:
        remove_output_dir(out, "out")
    make_output_dir(out, "out")
    return latest_checkpoint(out) if config.resume else None


def _check_resume(config: DistillConfig, out: Path) -> None:
    saved_path = out / _FINAL_MARKER
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    current = config.to_dict()
    for key in RESUME_KEYS:
        if key in saved and saved[key] != current[key]:
            raise ConfigError(key, f"--resume: the run in {out} used {key}={saved[key]!r}, now {current[key]!r}; "
                              "use the same value or start a new run (--force / a new --out)")


def _load_target(config: DistillConfig, device: torch.device, dtype: torch.dtype):
    from toolkit.recipe import ModelSpec
    from toolkit.session import SHARED_POOL

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return SHARED_POOL.get(ModelSpec(source=config.target, precision=precision, device=device.type), "target")


def _markdown(metrics: dict) -> str:
    before, after, train = metrics["before"], metrics["after"], metrics["training"]
    rows = [("top-1 agreement", "top1_agreement", "{:.1%}"), ("KL(target||draft), nats/token", "kl", "{:.3f}"),
            (f"acceptance rate alpha (K={metrics['eval']['k']})", "alpha", "{:.3f}"),
            ("tokens per round tau", "tokens_per_round", "{:.3f}")]
    lines = [f"# Draft distillation: {metrics['config']['target']} -> {metrics['draft']['layers']}-layer draft", "",
             f"Draft layers initialized from target layers {metrics['draft']['init_layers']} "
             f"(of {metrics['draft']['target_layers']}); {metrics['draft']['trainable_parameters']:,} trainable / "
             f"{metrics['draft']['parameters']:,} parameters; embedding and LM head "
             f"{'frozen' if metrics['config']['freeze_embeddings'] else 'trained'}.", "",
             f"Training: {train['steps']} steps, {train['tokens']:,} tokens, {train['minutes']:.1f} min "
             f"({train['tokens_per_second']:.0f} tokens/s), temperature {metrics['config']['temperature']}, "
             f"device {train['device']}, precision {train['precision']}; loss {train['first_loss']:.3f} -> "
             f"{train['last_loss']:.3f} (mean of first / last 10 steps). Stopped by: {train['stopped_by']}.", "",
             f"Held-out evaluation: {metrics['eval']['windows']} windows x {metrics['eval']['seq_len']} tokens "
             f"(agreement, KL); {metrics['eval']['prompts']} prompts x {metrics['eval']['prompt_len']} tokens, "
             f"{metrics['eval']['new_tokens']} new tokens each, greedy, EOS ignored (alpha, tau).", "",
             "| metric | before | after |", "|---|---|---|"]
    for label, key, fmt in rows:
        if key in before and key in after:
            lines.append(f"| {label} | {fmt.format(before[key])} | {fmt.format(after[key])} |")
    return "\n".join(lines) + "\n"


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
    (SIGTERM exits with status 143); ``resume=True`` continues from it with nothing lost.

    Raises:
        ConfigError: a field is invalid — ``layers`` (N < 1 or N >= target layers), ``target`` (no LM head,
            quantized), ``out`` (exists without ``resume`` / ``force``), ``data`` (no usable text), ``tokenizer``
            (a target model without its tokenizer), or a field that differs from the run being resumed.
        ModelLoadError: the target cannot be loaded.
    """
    config = dataclasses.replace(config or DistillConfig(), **overrides)
    config.validate()
    if target_model is not None and tokenizer is None:
        raise ConfigError("tokenizer", "a target model passed in needs its tokenizer too")
    if config.threads:
        torch.set_num_threads(config.threads)
    from toolkit.models import resolve_device

    device = resolve_device(config.device)
    precision = config.precision if config.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch_dtype(precision)
    autocast_dtype = None if dtype == torch.float32 else dtype

    _check_out(config)  # fail fast on bad input, before loading anything or touching the output directory
    if config.resume:
        _check_resume(config, config.out)
    if target_model is None:
        target_model, tokenizer = _load_target(config, device, dtype)
    else:
        device = next(target_model.parameters()).device
    target = target_model
    target_layers = check_target(target, config.layers)
    sources = config.init_layers(target_layers)
    target.eval()
    target.requires_grad_(False)
    checkpoint = _prepare_out(config)
    out: Path = config.out

    batch_size = config.batch_size or (32 if device.type == "cuda" else 4)
    seq_len = config.seq_len or (512 if device.type == "cuda" else 256)
    tokens_per_step = batch_size * seq_len
    total_steps = math.ceil(config.tokens / tokens_per_step)
    warmup = config.warmup_steps if config.warmup_steps is not None else min(100, max(1, total_steps // 20))
    atomic_write_json(out / _FINAL_MARKER, config.to_dict())

    streams, manifest = load_streams(config.data, config.heldout_fraction, tokenizer, out / "data")
    sampler = BlockSampler(streams["train"], seq_len, batch_size, config.seed)
    windows = heldout_windows(streams["heldout"], seq_len, config.eval_windows)
    prompts = heldout_windows(streams["heldout"], config.eval_prompt_len, config.eval_prompts)

    def run_eval(model) -> dict:
        return evaluate(target, model, windows, prompts, config.eval_new_tokens, config.eval_k, autocast_dtype)

    if checkpoint is not None:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
        set_trainable(draft, config.freeze_embeddings)
        state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    else:
        draft = build_draft(target, config.layers, sources, freeze_embeddings=config.freeze_embeddings,
                            seed=config.seed)
        state = {"step": 0, "elapsed_s": 0.0, "losses": [], "optimizer": None}
    resumed_from = state["step"] if checkpoint is not None else None
    if resumed_from is not None:
        log.info("resuming %s from step %d (%s)", out, resumed_from, checkpoint)

    before_path = out / "eval_before.json"
    if before_path.is_file():
        before = json.loads(before_path.read_text())
    else:
        if state["step"] != 0:
            raise ConfigError("resume", f"{out} has a checkpoint but no eval_before.json; start over with --force")
        before = run_eval(draft)
        atomic_write_json(before_path, before)

    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)

    step, elapsed, losses = state["step"], state["elapsed_s"], list(state["losses"])
    budget_s = config.max_minutes * 60 if config.max_minutes is not None else math.inf

    def snapshot() -> dict:
        return {"step": step, "elapsed_s": elapsed, "losses": losses, "optimizer": optimizer.state_dict(),
                "tokens_per_step": tokens_per_step, "total_steps": total_steps,
                "data_position": {"epoch_offset": sampler.position(step), "blocks": sampler.num_blocks},
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

    stop_signal = {"term": False}
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            stop_signal["term"] = True
        previous_handler = signal.signal(signal.SIGTERM, on_term)

    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps * tokens_per_step, initial=step * tokens_per_step, unit="tok", unit_scale=True,
               desc=f"distill {config.layers}L", dynamic_ncols=True, disable=not progress,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    stopped_by = "tokens"
    last_ckpt_time = time.monotonic()
    last_ckpt_step = step
    log_path = out / "train_log.jsonl"
    session_tokens, session_start = 0, time.perf_counter()
    try:
        with open(log_path, "a") as log_file:
            if resumed_from is not None:
                log_file.write(json.dumps({"event": "resume", "step": step}) + "\n")
            while step < total_steps:
                if elapsed >= budget_s:
                    stopped_by = "max_minutes"
                    break
                if stop_signal["term"]:
                    stopped_by = "sigterm"
                    break
                t0 = time.perf_counter()
                batch = sampler.batch(step).to(device)
                lr = learning_rate(step, total_steps, config.lr, warmup, config.min_lr_ratio,
                                   elapsed / budget_s if math.isfinite(budget_s) else 0.0)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype,
                                                     enabled=autocast_dtype is not None):
                    teacher_logits = target(input_ids=batch, use_cache=False).logits
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    student_logits = draft(input_ids=batch, use_cache=False).logits
                loss = kd_loss(teacher_logits, student_logits, config.temperature)
                del teacher_logits
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
                optimizer.step()
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"distillation loss became {loss_value} at step {step}; lower --lr")
                del student_logits, loss
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                step += 1
                elapsed += dt
                losses.append(loss_value)
                session_tokens += tokens_per_step
                tok_s = tokens_per_step / dt
                bar.update(tokens_per_step)
                bar.set_postfix(loss=f"{loss_value:.3f}", step=step, refresh=False)
                log_file.write(json.dumps({"step": step, "loss": round(loss_value, 5), "lr": lr,
                                           "tokens_per_s": round(tok_s, 1), "elapsed_s": round(elapsed, 2)}) + "\n")
                log_file.flush()
                if callback is not None:
                    callback(step, loss_value)
                due = (step - last_ckpt_step >= config.checkpoint_every
                       or time.monotonic() - last_ckpt_time >= config.checkpoint_minutes * 60)
                if due and step < total_steps:
                    save_checkpoint(out, draft, tokenizer, snapshot())
                    last_ckpt_time, last_ckpt_step = time.monotonic(), step
    except KeyboardInterrupt:
        bar.close()
        if step > last_ckpt_step or latest_checkpoint(out) is None:
            save_checkpoint(out, draft, tokenizer, snapshot())
        log.warning("interrupted at step %d; checkpoint saved, continue with --resume", step)
        raise
    finally:
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    session_wall_s = time.perf_counter() - session_start  # this process's training wall time (checkpoints included)
    save_checkpoint(out, draft, tokenizer, snapshot())
    if stopped_by == "sigterm":
        log.warning("SIGTERM at step %d; checkpoint saved, continue with --resume", step)
        raise SystemExit(143)

    draft.eval()
    save_final(out, draft, tokenizer)
    after = run_eval(draft)
    head = losses[:10]
    tail = losses[-10:]
    metrics = {
        "config": config.to_dict(),
        "draft": {"layers": config.layers, "target_layers": target_layers, "init_layers": sources,
                  "architecture": type(draft).__name__,
                  "parameters": sum(p.numel() for p in draft.parameters()),
                  "trainable_parameters": sum(p.numel() for p in trainable)},
        "training": {"steps": step, "total_steps": total_steps, "tokens": step * tokens_per_step,
                     "batch_size": batch_size, "seq_len": seq_len, "warmup_steps": warmup,
                     "seconds": elapsed, "minutes": elapsed / 60,
                     "tokens_per_second": step * tokens_per_step / elapsed if elapsed else 0.0,
                     "session_tokens_per_second": session_tokens / max(1e-9, session_wall_s),
                     "first_loss": sum(head) / len(head) if head else float("nan"),
                     "last_loss": sum(tail) / len(tail) if tail else float("nan"),
                     "losses": losses, "stopped_by": stopped_by, "resumed_from_step": resumed_from,
                     "device": str(device), "precision": precision, "threads": torch.get_num_threads()},
        "data": manifest,
        "eval": {"windows": int(windows.shape[0]), "seq_len": seq_len, "prompts": int(prompts.shape[0]),
                 "prompt_len": config.eval_prompt_len, "new_tokens": config.eval_new_tokens, "k": config.eval_k},
        "before": before,
        "after": after,
        "out": str(out),
    }
    atomic_write_json(out / "metrics.json", metrics)
    atomic_write_text(out / "report.md", _markdown(metrics))
    return metrics
