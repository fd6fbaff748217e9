"""``toolkit export vllm|sglang RECIPE``: print and write a serving engine's configuration for a recipe.

vLLM: a JSON file ``{"config": LLM(**config) arguments, "sampling": SamplingParams, "command": "vllm serve ...",
"warnings": [...]}``; SGLang: a shell script running ``python -m sglang.launch_server`` with the ``--speculative-*``
flags, its warnings as comments. Warnings (what the engine cannot express) are printed next to the output and kept
in the file; nothing is dropped silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from toolkit_cli.errors import reported

export_app = typer.Typer(no_args_is_help=True, help="Export a recipe to a serving engine (vLLM, SGLang).")


def _export(engine: str, recipe: str, out: Optional[Path]) -> None:
    from toolkit.export import export, render
    from toolkit.export.common import one_line
    from toolkit.io import atomic_write_text
    from toolkit.recipe import Recipe
    from toolkit.resources import resolve

    recipe_path = resolve(recipe, "", "recipe")  # a YAML file or a shipped recipe's name, as every other command
    exp = export(Recipe.load(recipe_path), engine)
    text, suffix = render(exp)
    path = out if out is not None else Path(recipe_path.stem + suffix)
    atomic_write_text(path, text)
    typer.echo(text, nl=False)
    for w in exp.warnings:
        typer.secho(f"warning: {one_line(w)}", fg="yellow", err=True)
    typer.secho(f"written: {path} ({len(exp.warnings)} warning(s))", err=True)


@export_app.command("vllm")
@reported
def vllm(recipe: str = typer.Argument(..., help="recipe YAML file or shipped recipe name"),
         out: Optional[Path] = typer.Option(None, help="file to write (default ./<recipe>.vllm.json)")):
    """Print and write the vLLM configuration (speculative_config, quantization, kv_cache_dtype) of RECIPE."""
    _export("vllm", recipe, out)


@export_app.command("sglang")
@reported
def sglang(recipe: str = typer.Argument(..., help="recipe YAML file or shipped recipe name"),
           out: Optional[Path] = typer.Option(None, help="file to write (default ./<recipe>.sglang.sh)")):
    """Print and write the SGLang launch command (--speculative-* flags) of RECIPE."""
    _export("sglang", recipe, out)
