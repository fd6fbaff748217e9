"""Where a distillation run writes (checkpoints, the final draft, the report), and what it checks first: the output directory (``--force`` / ``--resume``
rules, :mod:`toolkit.outdirs`), the configuration a resumed run must share, and the Markdown report."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from toolkit.distill.checkpoints import latest_checkpoint, save_state, write_checkpoint
from toolkit.distill.config import RESUME_KEYS, DistillConfig
from toolkit.errors import ConfigError
from toolkit.io import fsync_dir, fsync_tree

#: written last into ``out`` by a finished run; its configuration, checked on --resume
FINAL_MARKER = "distill_config.json"


def check_out(config: DistillConfig) -> None:
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


def prepare_out(config: DistillConfig) -> Path | None:
    """Apply --force (delete a directory the toolkit created) / --resume to ``config.out``, which is then a marked
    toolkit output directory; returns the checkpoint to resume from (or None)."""
    from toolkit.outdirs import make_output_dir, remove_output_dir

    check_out(config)
    out: Path = config.out
    if config.force:
        remove_output_dir(out, "out")
    make_output_dir(out, "out")
    return latest_checkpoint(out) if config.resume else None


def check_resume(config: DistillConfig, out: Path) -> None:
    saved_path = out / FINAL_MARKER
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    current = config.to_dict()
    for key in RESUME_KEYS:
        if key in saved and saved[key] != current[key]:
            raise ConfigError(key, f"--resume: the run in {out} used {key}={saved[key]!r}, now {current[key]!r}; "
                              "use the same value or start a new run (--force / a new --out)")


def markdown(metrics: dict) -> str:
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


def save_checkpoint(out: Path, draft, tokenizer, state: dict) -> Path:
    """Write ``checkpoints/step-NNNNNN`` atomically and durably (:func:`write_checkpoint`), point ``LATEST`` at it,
    delete older checkpoints. ``state`` holds the optimizer state dict, step, clock, losses and RNG states; it is
    stored as safetensors + JSON (:func:`toolkit.distill.checkpoints.save_state`), never pickled."""

    def write(tmp: Path) -> None:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        save_state(tmp, state)

    return write_checkpoint(out, state["step"], write)


def save_final(out: Path, draft, tokenizer) -> None:
    """Write the draft as a standard HF model directory into ``out`` (files made durable in a temp dir, then renamed
    in one by one; ``config.json`` last, so a directory with ``config.json`` always has its weights)."""
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".final."))
    try:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        names.sort(key=lambda n: n == "config.json")
        for name in names:
            os.replace(tmp / name, out / name)
        fsync_dir(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
