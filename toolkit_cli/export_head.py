"""``toolkit draft export-head``: write an EAGLE head in the layout an engine serves (speculators for vLLM, the
EAGLE repositories' for vLLM / SGLang); see :mod:`toolkit.eagle.convert`. Registered on the ``draft`` sub-app in
:mod:`toolkit_cli.app`.

Example: ``toolkit draft export-head results/eagle/head/best --layout speculators --out heads/smollm2-eagle3``, then
``vllm serve heads/smollm2-eagle3`` (the verifier is named inside). Exit status 0 on success, 2 on a configuration
error naming the field (:mod:`toolkit_cli.errors`).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit.dtypes import FLOAT_DTYPES
from toolkit_cli.errors import reported


def _verifier(target: str) -> str:
    """The verifier a speculators config names: the hub checkpoint of the embedded model, a local target's absolute
    path (the engine may run elsewhere), else ``target`` as given (a hub id)."""
    from toolkit.export.common import EMBEDDED_HUB_ID

    if target == "embedded":
        return EMBEDDED_HUB_ID
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else target


def _target_config(target: str):
    """The target's transformers config, read without loading weights (a ``.gguf`` file's from its header: nothing
    is dequantized; ``embedded``: from its converted copy, made at set-up). Raises ConfigError (``--target``) when it
    cannot be read."""
    from transformers import AutoConfig

    from toolkit.errors import ConfigError, ModelLoadError
    from toolkit.models.embedded import resolve_source

    try:
        if target.endswith(".gguf"):
            gguf = Path(target).expanduser()
            if not gguf.is_file():
                raise ConfigError("--target", f"GGUF file {target!r} does not exist")
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoConfig.from_pretrained(resolve_source(target, "--target"))  # embedded: its converted copy
    except ModelLoadError as exc:
        raise ConfigError("--target", str(exc)) from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("--target", f"cannot read the config of {target!r} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


@reported
def export_head_command(
    head: Annotated[str, typer.Argument(help="EAGLE head directory (any layout the toolkit reads), or 'embedded' "
                                             "for the shipped head.")],
    out: Annotated[Path, typer.Option(help="Output directory (created; must not exist or be empty).")],
    layout: Annotated[str, typer.Option(help="'speculators' (vLLM; EAGLE-3 heads) or 'eagle' (the EAGLE / EAGLE-3 "
                                             "repositories' layout: vLLM and SGLang).")] = "speculators",
    target: Annotated[str, typer.Option(help="The head's target: 'embedded', a local HF directory or .gguf file, or "
                                             "a hub id (only its config is read).")] = "embedded",
    verifier: Annotated[Optional[str], typer.Option(help="Verifier named in the speculators config (default: the "
                                                         "target; the embedded model's hub id for 'embedded').")]
    = None,
    num_speculative_tokens: Annotated[int, typer.Option("--num-speculative-tokens", "-k",
                                                        help="K per round in the speculators config.")] = 3,
    dtype: Annotated[str, typer.Option(help=f"Weights dtype: {', '.join(FLOAT_DTYPES)}.")] = "bf16",
) -> dict:
    """Convert ``head`` for ``target`` into ``out``; prints what was written and any warning."""

    from toolkit.eagle.checkpoint import resolve_head
    from toolkit.eagle.convert import convert_head
    from toolkit.errors import ConfigError

    if dtype not in FLOAT_DTYPES:
        raise ConfigError("--dtype", f"{dtype!r} is not allowed; allowed: {', '.join(FLOAT_DTYPES)}")
    source = resolve_head(head, "head")
    config = _target_config(target)
    name = verifier or _verifier(target)
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:  # a GGUF's config names none: the causal-LM class transformers maps its model type to
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        architectures = [causal_lm] if causal_lm else []
    summary = convert_head(source, config, out, layout, name, architectures,
                           num_speculative_tokens, FLOAT_DTYPES[dtype], field="head")
    typer.echo(f"wrote {summary['variant']} head in the {layout} layout to {out}: {summary['tensors']} tensors, "
               f"{summary['bytes'] / 2**20:.1f} MiB ({dtype})")
    if layout == "speculators":
        typer.echo(f"serve: vllm serve {shlex.quote(str(out))}   (verifier: {name})")
    for warning in summary["warnings"]:
        typer.echo(f"warning: {warning}", err=True)
    return summary
