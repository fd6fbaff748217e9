"""Convert an EAGLE head directory between layouts, for the engines to serve it (``toolkit draft export-head``).

* ``speculators``: EAGLE-3 heads for ``vllm serve HEAD`` (the verifier named inside) or a vLLM
  ``speculative_config`` with ``method: eagle3`` (:mod:`toolkit.eagle.speculators`);
* ``eagle``: the EAGLE / EAGLE-3 repositories' layout (vLLM ``method: eagle`` / ``eagle3``, SGLang ``EAGLE`` /
  ``EAGLE3``), without this toolkit's ``toolkit_eagle`` section. An EAGLE-1 head trained over a reduced draft
  vocabulary drops it here (EAGLE-1's layout has no ``d2t``; it drafts over the target's whole LM head, so acceptance
  may differ, the output does not).

Any layout :func:`toolkit.eagle.checkpoint.read_checkpoint` reads is accepted as input. The head is checked against
the target's config (hidden size, vocabulary, layer count) and every tensor's shape before anything is written;
the output directory appears complete or not at all.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import torch

from toolkit.errors import ConfigError

LAYOUTS = ("speculators", "eagle")


def _check_tensors(state: dict, config, directory: Path, field: str) -> None:
    """ConfigError (``field``) unless ``state`` (EAGLE-3 / EAGLE-1 repository names) holds every tensor the head of
    ``config`` needs (the embedding may be missing: the target's is used; an EAGLE-1 head may lack its LM head: the
    target's rows are used) and each of its shape; the head is built on the meta device (no memory)."""
    from toolkit.eagle.checkpoint import build_checked, check_tensors, to_head_names

    expected = build_checked(config, field, device="meta").state_dict()
    ours = to_head_names(state, config.variant)
    optional = {"embed_tokens.weight"} | ({"lm_head.weight"} if config.variant == "eagle1" else set())
    check_tensors(ours, expected, config.variant, directory, field, optional)


def _check_out(out: Path, source: Path) -> None:
    """``--out`` must be a new (or empty) directory, never the head being converted."""
    if out.exists() and out.resolve() == source.resolve():
        raise ConfigError("--out", f"{out} is the head being converted; choose a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", f"{out} exists and is not an empty directory; choose a new directory (nothing "
                          "is overwritten)")


def _write(out: Path, layout: str, state: dict, config: dict) -> None:
    """Write ``config.json`` + ``model.safetensors`` in ``layout`` into a private sibling of ``out``, then put it in
    place (:func:`toolkit.io.replace_dir`): ``out`` appears complete or not at all."""
    from toolkit.eagle.files import write_head_files
    from toolkit.eagle.speculators import write_speculators
    from toolkit.io import _umask, replace_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the head is an ordinary output directory
    try:
        (write_speculators if layout == "speculators" else write_head_files)(tmp, state, config)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_head(source: str | Path, target_config, out: str | Path, layout: str, verifier: str,
                 verifier_architectures: list[str], num_speculative_tokens: int = 3,
                 dtype: torch.dtype = torch.bfloat16, field: str = "draft.source") -> dict:
    """Write the head at ``source`` into ``out`` in ``layout``, floating-point tensors cast to ``dtype``.

    Args:
        target_config: the target's transformers config (the head is fitted to it; no weights are loaded).
        verifier / verifier_architectures: what the speculators config names as the verifier (a hub id or path).
        num_speculative_tokens: K proposed per round (speculators' greedy proposal method; vLLM's default K).

    Returns ``{"layout", "variant", "out", "tensors", "bytes", "warnings"}``.

    Raises:
        ConfigError: ``layout`` not one of :data:`LAYOUTS`; ``--out`` the source or an existing non-empty path;
            ``num_speculative_tokens`` < 1; an EAGLE-1 head to ``speculators``; a Qwen3-shaped head (q/k norms) to
            ``eagle`` (the EAGLE-3 repository's layer is Llama's); a head that does not fit the target, lacks a
            tensor, or reads a feature layer the engines cannot give it (``field``).
    """
    from toolkit.eagle.checkpoint import _head_config, eagle_config, read_checkpoint
    from toolkit.eagle.head import text_config
    from toolkit.eagle.speculators import check_exportable, speculators_config

    if layout not in LAYOUTS:
        raise ConfigError("layout", f"{layout!r} is not a head layout; allowed: {', '.join(LAYOUTS)}")
    if num_speculative_tokens < 1:
        raise ConfigError("num_speculative_tokens", f"must be >= 1, got {num_speculative_tokens}")
    out = Path(out)
    directory, raw, state, variant = read_checkpoint(source, field)
    _check_out(out, directory)
    config = _head_config(raw, state, variant, target_config, field)
    text = text_config(target_config)
    layers = text.num_hidden_layers
    config = dataclasses.replace(config, feature_layers=[i % layers for i in config.feature_layers])  # ids >= 0
    if variant == "eagle3" and any(i > layers - 2 for i in config.feature_layers):
        raise ConfigError(field, f"feature layers {config.feature_layers} include the target's last layer "
                          f"({layers - 1}): engines give an EAGLE-3 head output_hidden_states indices "
                          f"1..{layers - 1}, i.e. decoder layers 0..{layers - 2}")
    _check_tensors(state, config, directory, field)
    warnings = []
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if layout == "speculators":
        check_exportable(config, "layout")
    elif config.qk_norm:
        raise ConfigError("layout", "this head norms queries and keys (a Qwen3 layer), which the EAGLE-3 "
                          "repository's Llama layer has not; allowed for it: 'speculators'")
    elif variant == "eagle1" and "d2t" in state:
        warnings.append(f"the reduced draft vocabulary ({config.draft_vocab_size} of {config.vocab_size} tokens) is "
                        "dropped: EAGLE-1's layout has no d2t, so the engine drafts over the whole vocabulary")
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d", "lm_head.weight")}
        config = dataclasses.replace(config, draft_vocab_size=config.vocab_size)
    meta = speculators_config(config, verifier, verifier_architectures, num_speculative_tokens,
                              str(dtype).removeprefix("torch."), getattr(text, "max_position_embeddings", None)) \
        if layout == "speculators" else eagle_config(config, toolkit=False)
    _write(out, layout, state, meta)
    return {"layout": layout, "variant": variant, "out": str(out), "tensors": len(state),
            "bytes": sum(v.numel() * v.element_size() for v in state.values()), "warnings": warnings}
