"""Export a recipe to a serving engine's configuration: ``toolkit export vllm|sglang RECIPE``.

Each engine has one module (:mod:`toolkit.export.vllm`, :mod:`toolkit.export.sglang`) that maps what the engine can
express (on the shared core in :mod:`toolkit.export.common`); :mod:`toolkit.export.gaps` lists, per engine, what it
cannot (our KV compression policies, NF4 drafts, adaptive K, ...) as warnings that travel with the output — nothing
in the recipe is dropped silently.
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
    """

    engine: str
    config: dict
    sampling: dict
    command: str
    warnings: list[str] = field(default_factory=list)


def export(recipe, engine: str) -> Export:
    """The ``engine`` configuration of ``recipe`` (a :class:`toolkit.recipe.Recipe`).

    Raises:
        ConfigError: unknown engine (field ``engine``).
    """
    from toolkit.checks import check_choice

    check_choice("engine", engine, ENGINES)
    if engine == "vllm":
        from toolkit.export.vllm import to_vllm

        return to_vllm(recipe)
    from toolkit.export.sglang import to_sglang

    return to_sglang(recipe)
