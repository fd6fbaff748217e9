"""What every exporter shares: the target's engine arguments, the model path of a model spec, the draft model a
drafter runs, the EAGLE head's variant. What the engines cannot express is in :mod:`toolkit.export.gaps`.

What a drafter is to the engines (its method name, its parameters, whether it runs a draft LM) comes from its
registered config (:mod:`toolkit.speculative.drafters.registry`), never from comparing drafter names.
"""

from __future__ import annotations

import shlex
import unicodedata

from toolkit.errors import ConfigError
from toolkit.speculative.drafters.registry import DRAFT_TARGET

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the checkpoint the embedded GGUF was made from

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
#: the engines' ``dtype`` for each target precision (int8 / int4 load in-flight quantized, native a GGUF's own blocks:
#: dtype picked by the engine)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "auto", "int4": "auto", "native": "auto"}


def target_config(recipe, model_key: str, warnings: list[str]) -> dict:
    """The engine arguments every exporter shares: the model (under ``model_key``), dtype, quantization, KV dtype."""
    config: dict = {model_key: model_path(recipe.target, "target", warnings), "dtype": DTYPES[recipe.target.precision]}
    if recipe.target.precision in ("int8", "int4"):
        config["quantization"] = "bitsandbytes"
    elif recipe.target.precision == "native" and recipe.target.source.endswith(".gguf"):
        config["quantization"] = "gguf"  # the engines read the file's blocks themselves
    config["kv_cache_dtype"] = "auto"
    return config


def _unsafe(char: str) -> bool:
    """Control characters (newline, carriage return, escape, ...) and Unicode line / paragraph separators."""
    return unicodedata.category(char) in ("Cc", "Zl", "Zp")


def command_value(field: str, value: str) -> str:
    """``value`` unchanged when it may be an argument of the engine's command line.

    Raises:
        ConfigError (``field``): a control character (a newline ends a command in a shell script; an escape
            sequence rewrites the terminal that prints it), or a leading ``-`` (the engine would read an option).
    """
    bad = sorted({repr(c) for c in value if _unsafe(c)})
    if bad:
        raise ConfigError(field, f"contains control characters {', '.join(bad)}; it cannot be exported to a command "
                          "line")
    if value.startswith("-"):
        raise ConfigError(field, f"starts with '-' ({value!r}): an engine would read it as an option; write ./{value} "
                          "for a local path")
    return value


def one_line(text: str) -> str:
    """``text`` with every control character and line separator written as an escape (``\\n``, ``\\x1b``,
    ``\\u2028``): safe in a ``#`` comment of a shell script (nothing can end the comment) and on a terminal."""
    return "".join(c.encode("unicode_escape").decode("ascii") if _unsafe(c) else c for c in text)


def model_path(spec, prefix: str, warnings: list[str]) -> str:
    """The engine's model argument for a ``ModelSpec`` (``embedded`` maps to its hub checkpoint).

    Raises:
        ConfigError (``PREFIX.source``): a source that cannot go into a command line (:func:`command_value`).
    """
    command_value(f"{prefix}.source", spec.source)
    if spec.source == "embedded":
        here = ("run here on the file's own Q4_1 / Q8_0 blocks (precision native)" if spec.precision == "native"
                else f"dequantized here (precision {spec.precision})")
        warnings.append(f"{prefix}.source: 'embedded' is the Q4_1 GGUF of {EMBEDDED_HUB_ID}, {here}; the engine "
                        f"loads the original hub checkpoint {EMBEDDED_HUB_ID} (higher precision, so outputs can differ "
                        f"slightly from this toolkit's){_gguf_hint(spec)}")
        return EMBEDDED_HUB_ID
    if spec.source.endswith(".gguf"):
        warnings.append(f"{prefix}.source: a .gguf file; the engine's GGUF support is partial — prefer the "
                        "original HF checkpoint")
    return spec.source


def _gguf_hint(spec) -> str:
    """For a ``native`` embedded target: where the GGUF file itself is, for an engine that loads GGUF files (partial
    support: the hub checkpoint is the exported default)."""
    if spec.precision != "native":
        return ""
    from toolkit.errors import ModelLoadError
    from toolkit.models.embedded import embedded_gguf_path

    try:
        return f"; the same blocks are the file {embedded_gguf_path()} (GGUF: the engine's support is partial)"
    except ModelLoadError:
        return ""


def draft_source(recipe) -> tuple:
    """``(ModelSpec, role)`` of the draft LM a drafter runs: the target's own checkpoint for a drafter that drafts
    with the target's weights (``self``), else the recipe's ``draft`` section."""
    if recipe.spec.config.draft == DRAFT_TARGET:
        return recipe.target, "target"
    return recipe.draft, "draft"


def _eagle_head(recipe) -> tuple:
    """``(directory, config.json as a dict)`` of the recipe's EAGLE head: ``draft.source`` with ``embedded`` resolved
    to the head shipped inside the package; the dict is empty when the config cannot be read here."""
    import json
    from pathlib import Path

    from toolkit.eagle.checkpoint import SHIPPED

    source = str(recipe.draft.source)
    path = SHIPPED.get(source, Path(source).expanduser())
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return path, raw if isinstance(raw, dict) else {}


def eagle_variant(recipe) -> str:
    """``"eagle3"`` when the recipe's head directory holds an EAGLE-3 head, else ``"eagle"`` (EAGLE-1, also when the
    head cannot be read here). Read from the head's ``config.json`` the way :func:`toolkit.eagle.checkpoint.save_head`
    writes it (``toolkit_eagle.variant``), the speculators layout names it (``speculators_model_type``) or the
    EAGLE repositories' layouts do (``architectures``: ``...Eagle3``)."""
    if recipe.draft is None:
        return "eagle"
    _, raw = _eagle_head(recipe)
    variant = (raw.get("toolkit_eagle") or {}).get("variant") or raw.get("speculators_model_type")
    if variant is None:
        variant = "eagle3" if any("Eagle3" in a for a in raw.get("architectures") or []) else "eagle1"
    return "eagle3" if variant == "eagle3" else "eagle"


def eagle_head_path(recipe, warnings: list[str], engine: str) -> str:
    """The engine's draft-model argument for an EAGLE head: ``draft.source``, with ``embedded`` resolved to the
    head shipped inside the package (an absolute path on this machine). A warning names the conversion
    (``toolkit draft export-head``) when the head's layout is not one ``engine`` reads: this toolkit's own
    (``config.json`` with ``toolkit_eagle``; an EAGLE-1 head of it may carry a reduced vocabulary no engine reads),
    or speculators' for SGLang (which reads the EAGLE repositories' layout).

    Raises:
        ConfigError (``draft.source``): a source that cannot go into a command line (:func:`command_value`).
    """
    from toolkit.eagle.checkpoint import SHIPPED

    source = str(recipe.draft.source)
    path, raw = _eagle_head(recipe)

    def convert(layout: str) -> str:
        """The command that writes the head in ``layout`` for this recipe's target (quoted, one line)."""
        return one_line(shlex.join(["toolkit", "draft", "export-head", source, "--target", str(recipe.target.source),
                                    "--layout", layout, "--out", "DIR"]))

    if "toolkit_eagle" in raw:
        layout = "speculators" if engine == "vllm" and eagle_variant(recipe) == "eagle3" else "eagle"
        warnings.append(f"draft.source: {source!r} is an EAGLE head in this toolkit's layout (config.json "
                        f"'toolkit_eagle'); write it in a layout {ENGINE_NAMES[engine]} loads with "
                        f"`{convert(layout)}` and point the engine at DIR")
    elif "speculators_model_type" in raw and engine != "vllm":
        warnings.append(f"draft.source: {source!r} is a head in the speculators layout, which "
                        f"{ENGINE_NAMES[engine]} does not read; write it in the EAGLE-3 repository's layout with "
                        f"`{convert('eagle')}` and point the engine at DIR")
    if recipe.draft.precision == "int8":
        warnings.append(f"draft.precision: int8 — the head's int8 weights are made at load time here "
                        f"(toolkit.eagle.precision); {ENGINE_NAMES[engine]} runs the head at the engine's dtype")
    return command_value("draft.source", str(path) if source in SHIPPED or path.is_dir() else source)
