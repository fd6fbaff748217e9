"""``toolkit draft distill``: train a small draft for a target (:mod:`toolkit.distill`); registered on the
``draft`` sub-app in :mod:`toolkit_cli.app`.

Standalone: ``python -m toolkit_cli.distill --target embedded --layers 2 --tokens 2M --out DIR``.
Exit status: 0 on success, 2 on a configuration error (the message names the field), 130 on Ctrl-C and 143 on
SIGTERM (a checkpoint is saved first; rerun with ``--resume``); errors are reported by :mod:`toolkit_cli.errors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit_cli.errors import reported


@reported
def distill_command(
    target: Annotated[str, typer.Option(help="Target (teacher): 'embedded', a local HF directory, a .gguf file or a "
                                             "hub id.")] = "embedded",
    layers: Annotated[int, typer.Option(help="N, decoder layers of the draft (1 <= N < target layers).")] = 2,
    tokens: Annotated[str, typer.Option(help="Training budget in tokens: 200000, 500k, 2M.")] = "1M",
    out: Annotated[Path, typer.Option(help="Output directory (becomes an HF model directory).")] = Path(
        "results/distill/draft"),
    data: Annotated[Optional[list[str]], typer.Option(
        help="Training text: files, directories, globs or hub:NAME[:CONFIG] (repeatable). Default: Python stdlib "
             "sources + /usr/share/common-licenses.")] = None,
    temperature: Annotated[float, typer.Option(help="KD temperature tau.")] = 1.0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --out.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Delete an existing --out and start over.")] = False,
    init: Annotated[str, typer.Option(help="Layer init: spaced, first, last, random or a list like '0,29'.")
                    ] = "spaced",
    train_embeddings: Annotated[bool, typer.Option("--train-embeddings",
                                                   help="Train embedding and LM head too (default: frozen).")
                                ] = False,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per step (default CPU 4, CUDA 32).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default CPU 256, CUDA 512).")] = None,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = 1e-3,
    warmup_steps: Annotated[Optional[int], typer.Option(help="Linear warmup steps (default min(100, steps/20)).")
                            ] = None,
    precision: Annotated[str, typer.Option(help="auto (CPU fp32, CUDA bf16), fp32, bf16, fp16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    max_minutes: Annotated[Optional[float], typer.Option(help="Stop training after this many minutes.")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Checkpoint every this many steps.")] = 50,
    eval_windows: Annotated[int, typer.Option(help="Held-out windows of seq_len tokens for agreement / KL.")] = 16,
    eval_prompts: Annotated[int, typer.Option(help="Held-out prompts for alpha / tokens per round.")] = 8,
    eval_new_tokens: Annotated[int, typer.Option(help="New tokens per held-out prompt.")] = 64,
    eval_k: Annotated[int, typer.Option(help="Draft length K for the acceptance evaluation.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the data order and random init.")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads.")] = None,
) -> dict:
    """Distill an N-layer draft from a target by KL at temperature tau; print before/after metrics.

    Returns the metrics dict (also in ``OUT/metrics.json``). Errors propagate (a :class:`toolkit.errors.ConfigError`
    names the field); the command line prints them on one line (:func:`toolkit_cli.errors.reported`).
    """
    import logging

    from toolkit.distill import DistillConfig, distill

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = DistillConfig(
            target=target, layers=layers, tokens=tokens, out=out, data=list(data or []), temperature=temperature,
            resume=resume, force=force, init=init, freeze_embeddings=not train_embeddings, batch_size=batch_size,
            seq_len=seq_len, lr=lr, warmup_steps=warmup_steps, precision=precision, device=device,
            max_minutes=max_minutes, checkpoint_every=checkpoint_every, eval_windows=eval_windows,
            eval_prompts=eval_prompts, eval_new_tokens=eval_new_tokens, eval_k=eval_k, seed=seed, threads=threads)
        metrics = distill(config)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; checkpoint saved in {out}. Continue with --resume.", err=True)
        raise typer.Exit(130) from None
    typer.echo((Path(metrics["out"]) / "report.md").read_text())
    return metrics


def main() -> None:
    typer.run(distill_command)


if __name__ == "__main__":
    main()
