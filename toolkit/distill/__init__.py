"""Draft distillation: train a small draft for speculative decoding from its target (``toolkit draft distill``).

A speculative decoder is only as good as its draft, and many targets (the embedded SmolLM2-135M-Instruct included)
have no small sibling with the same tokenizer. :func:`distill` builds one: an N-layer model of the target's own
architecture class that shares the target's tokenizer, embedding and LM head (copied, frozen), with its decoder
layers initialized from chosen target layers (evenly spaced by default), trained by knowledge distillation —
``tau^2 * KL(p_target^tau || p_draft^tau)`` on real text, teacher without gradients (Hinton et al. 2015;
DistillSpec, Zhou et al. 2024). The output directory is a standard HF model directory (``ModelSpec(source=DIR)``)
plus checkpoints, and ``metrics.json`` / ``report.md`` comparing, on held-out text, top-1 agreement with the target,
the acceptance rate alpha and tokens per round with the speculative decoder before vs after training.

Python::

    from toolkit.distill import DistillConfig, distill
    metrics = distill(DistillConfig(target="embedded", layers=2, tokens="2M", out="results/distill/smollm2-2l"))

CLI (see :mod:`toolkit_cli.distill`)::

    toolkit draft distill --target embedded --layers 2 --tokens 2M --out results/distill/smollm2-2l
"""

from toolkit.distill.config import DistillConfig, parse_tokens
from toolkit.distill.draft import build_draft, check_target
from toolkit.distill.evaluate import acceptance, agreement, evaluate, kd_loss
from toolkit.distill.trainer import distill, latest_checkpoint

__all__ = ["DistillConfig", "distill", "build_draft", "check_target", "kd_loss", "agreement", "acceptance",
           "evaluate", "latest_checkpoint", "parse_tokens"]
