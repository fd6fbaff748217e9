"""``toolkit draft eagle``: train an EAGLE head for a target (see :mod:`toolkit.distill.eagle_train`); registered
on the ``draft`` sub-app in :mod:`toolkit_cli.app`.

Standalone: ``python -m toolkit_cli.eagle --target embedded --minutes 40 --out results/eagle/smollm2``.
Exit status 0 on success, 2 on a configuration error (the message names the field); errors are reported by
:mod:`toolkit_cli.errors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit_cli.errors import reported


@reported
def eagle_command(
    target: Annotated[str, typer.Option(help="Target: 'embedded', a local HF directory or a hub id.")] = "embedded",
    out: Annotated[Path, typer.Option(help="Output directory (best/ is the head to ship).")] = Path(
        "results/eagle/head"),
    data: Annotated[Optional[list[str]], typer.Option(help="Text globs (repeatable); default: stdlib sources, "
                                                             "licenses, /usr/share/doc texts.")] = None,
    minutes: Annotated[float, typer.Option(help="Training wall time (the data preparation is extra).")] = 30.0,
    chat_minutes: Annotated[float, typer.Option(help="Time cap for the target's own chat answers.")] = 8.0,
    chat_prompts: Annotated[int, typer.Option(help="Training chat prompts (answered by the target).")] = 800,
    text_windows: Annotated[int, typer.Option(help="Windows of --seq-len tokens of local text.")] = 320,
    draft_vocab: Annotated[int, typer.Option(help="Reduced draft vocabulary size (most frequent tokens).")] = 8192,
    variant: Annotated[str, typer.Option(help="Head layout: eagle1 (feature regression + tokens, the target's LM "
                                              "head) or eagle3 (three feature layers, tokens only, its own LM "
                                              "head; exports to the speculators layout).")] = "eagle1",
    ttt_steps: Annotated[int, typer.Option(help="Unrolled draft steps in training (training-time test).")] = 3,
    reg_weight: Annotated[float, typer.Option(help="Weight of the standardised feature regression (eagle1; "
                                                   "EAGLE-3 learns tokens only).")] = 0.1,
    batch_size: Annotated[int, typer.Option(help="Windows per step.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 320,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = 1e-3,
    eval_every_minutes: Annotated[float, typer.Option(help="Held-out alpha evaluation cadence.")] = 3.0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --out.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Delete --out and start over.")] = False,
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads.")] = None,
) -> dict:
    """Train an EAGLE head; prints the held-out alpha curve. Errors propagate (a ConfigError names the field); the
    command line prints them on one line (:func:`toolkit_cli.errors.reported`)."""
    import logging

    import torch

    from toolkit.distill.eagle_train import DEFAULT_DATA, EagleTrainConfig, train_head

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    config = EagleTrainConfig(target=target, out=out, data=list(data or DEFAULT_DATA), minutes=minutes,
                              chat_minutes=chat_minutes, chat_prompts=chat_prompts, text_windows=text_windows,
                              draft_vocab=draft_vocab, variant=variant, ttt_steps=ttt_steps, reg_weight=reg_weight,
                              batch_size=batch_size, seq_len=seq_len, lr=lr,
                              eval_every_minutes=eval_every_minutes, resume=resume, force=force, seed=seed)
    summary = train_head(config)
    for point in summary["curve"]:
        typer.echo(f"tokens {point['tokens']:>9}  alpha {[round(a, 3) for a in point['alpha']]}  "
                   f"tau {point['tau']:.3f}")
    return summary


def main() -> None:
    typer.run(eagle_command)


if __name__ == "__main__":
    main()
