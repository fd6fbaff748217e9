"""Export a recipe to a serving engine's configuration: ``toolkit export vllm|sglang RECIPE``.

Each engine has one module (:mod:`toolkit.export.vllm`, :mod:`toolkit.export.sglang`) that maps what the engine can
express (on the shared core in :mod:`toolkit.export.common`); :mod:`toolkit.export.gaps` lists, per engine, what it
cannot (our KV compression policies, NF4 drafts, adaptive K, ...) as warnings that travel with the output — nothing
in the recipe is dropped silently.

Safety of the generated files: every value in a command line is shell-quoted (``shlex``); a value with a control
character or a leading ``-`` is refused with a :class:`~toolkit.errors.ConfigError` naming the recipe field; every
comment line (warnings, sampling parameters, the recipe name) has its control characters escaped, so no recipe value
can end a comment or a command (:func:`render`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("vllm", "sglang")


@dataclass
class Export:
    """An engine configuration for one recipe.

    Attributes:
        engine: ``vllm`` or ``sglang``.
        config: the engine's settings (vLLM: ``LLM(**config)`` keyword arguments; SGLang: server arguments by
            their ``--flag`` names without dashes).
        sampling: per-request sampling parameters (temperature, top_p, top_k, max_tokens / max_new_tokens).
        command: a shell command line that starts the engine's server with ``config``.
        warnings: what the recipe asks for that the engine cannot express, one line each naming the recipe field.
        recipe: the recipe's name (shown in the header of a generated script).
    """

    engine: str
    config: dict
    sampling: dict
    command: str
    warnings: list[str] = field(default_factory=list)
    recipe: str = ""


def export(recipe, engine: str) -> Export:
    """The ``engine`` configuration of ``recipe`` (a :class:`toolkit.recipe.Recipe`).

    Raises:
        ConfigError: unknown engine (field ``engine``).
    """
    from toolkit.checks import check_choice

    check_choice("engine", engine, ENGINES)
    if engine == "vllm":
        from toolkit.export.vllm import to_vllm

        result = to_vllm(recipe)
    else:
        from toolkit.export.sglang import to_sglang

        result = to_sglang(recipe)
    _check_command_values(result.config, engine)
    return result


def _check_command_values(value, path: str) -> None:
    """Backstop of :func:`toolkit.export.common.command_value` over every string of an engine configuration (the
    recipe fields are checked where they are read; this names the engine key of anything else)."""
    from toolkit.export.common import command_value

    if isinstance(value, dict):
        for key, item in value.items():
            _check_command_values(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_command_values(item, path)
    elif isinstance(value, str):
        command_value(path, value)


def render(exp: Export) -> tuple[str, str]:
    """``(file content, file suffix)`` of an export: vLLM a JSON document (``.vllm.json``), SGLang a ``/bin/sh``
    script (``.sglang.sh``) running :attr:`Export.command` with the sampling parameters, the recipe name and the
    warnings as comments, each comment line escaped by :func:`toolkit.export.common.one_line`."""
    import json

    from toolkit.export.common import one_line

    if exp.engine == "vllm":
        body = {"config": exp.config, "sampling": exp.sampling, "command": exp.command, "warnings": exp.warnings}
        return json.dumps(body, indent=2) + "\n", ".vllm.json"
    comments = [f"SGLang server for recipe {exp.recipe!r} (`toolkit export sglang`); per-request sampling parameters:",
                f"  {json.dumps(exp.sampling)}"] + [f"WARNING: {w}" for w in exp.warnings]
    lines = ["#!/bin/sh"] + [f"# {one_line(c)}" for c in comments] + ["exec " + exp.command, ""]
    return "\n".join(lines), ".sglang.sh"
