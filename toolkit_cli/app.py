"""Command line: ``toolkit run | generate | eval | search | draft distill``.

The command line sits above both the library (``toolkit``) and the measurement applications (``eval``); neither
imports it. Every command takes a recipe as a YAML file or the name of a shipped one (``short``, ``short-ngram``,
``long``, ``memory``, ...). Errors in a recipe or an argument print one line naming the field and exit with status
2; nothing half-written is left behind; an internal error says so on one line (status 1); ``toolkit --debug ...``
shows the traceback of either (:mod:`toolkit_cli.errors`). Outputs go to the working directory (or ``--out``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from toolkit_cli.errors import OneLineGroup, reported, set_debug

app = typer.Typer(cls=OneLineGroup, add_completion=False, no_args_is_help=True,
                  help="Speculative decoding with quantized weights and compressed KV caches.")
draft_app = typer.Typer(no_args_is_help=True, help="Build draft models for a target.")
app.add_typer(draft_app, name="draft")
from toolkit_cli.export import export_app  # noqa: E402  (toolkit export vllm|sglang)

app.add_typer(export_app, name="export")


@app.callback()
def options(debug: bool = typer.Option(False, "--debug", help="show the traceback of any error (also "
                                       "TOOLKIT_DEBUG=1)")):
    """Speculative decoding with quantized weights and compressed KV caches."""
    set_debug(debug)


def _check_out(out: Path) -> Path:
    """``--out`` must be a directory or not exist yet, checked before the (long) run rather than when writing."""
    from toolkit.errors import ConfigError

    for parent in (out, *out.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError("--out", f"{parent} exists and is not a directory")
            break
    return out


TARGET_HELP = ("your model instead of the recipe's target: a local HF directory or a .gguf file (on CPU a .gguf runs on "
               "its own quantized blocks, a directory quantized by torchao / bitsandbytes on its own weights: "
               "precision native)")
DRAFT_HELP = "your draft LM instead of the recipe's draft (another tokenizer is fine: drafted across tokenizers)"


def _retarget(recipe, target: Optional[str], draft: Optional[str]):
    """``recipe`` with its target (and the draft of a ``self`` drafter) on ``target``, its draft LM or EAGLE head on
    ``draft`` (:meth:`~toolkit.recipe.Recipe.with_target` / :meth:`~toolkit.recipe.Recipe.with_draft`: a GGUF on CPU
    or a checkpoint quantized by torchao / bitsandbytes runs on its own quantized weights, precision native)."""
    from toolkit.errors import ConfigError
    from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD

    if target is not None:
        if recipe.spec.config.draft == DRAFT_EAGLE_HEAD and recipe.draft.source == "embedded" and draft is None:
            raise ConfigError("--draft", "the recipe's EAGLE head was trained for the embedded model; pass a head "
                              "for your target with --draft (toolkit draft eagle --target ...)")
        recipe = recipe.with_target(target)
    return recipe.with_draft(draft, "--draft") if draft is not None else recipe


def _load(recipe: str):
    """A recipe from a YAML path or a shipped name. Raises ConfigError."""
    from toolkit.recipe import Recipe
    from toolkit.resources import resolve

    return Recipe.load(resolve(recipe, "", "recipe"))


@app.command()
@reported
def run(recipe: str = typer.Argument(..., help="recipe YAML file or shipped recipe name"),
        compare: bool = typer.Option(False, "--compare", help="also run HF AR (eager and static-cache "
                                     "compiled) / assisted / prompt-lookup baselines, and llama.cpp / OpenVINO when "
                                     "installed (make bench-cpu-engines)"),
        repeats: int = typer.Option(3, min=1, help="timed repetitions per prompt and method (with --compare)"),
        max_new_tokens: Optional[int] = typer.Option(None, min=1, help="override generation.max_new_tokens"),
        num_prompts: Optional[int] = typer.Option(None, min=1, help="use N prompts of the suite, spread over kinds"),
        time_budget: Optional[float] = typer.Option(None, min=1, help="seconds: start no timed repetition that would "
                                                    "end later (at least one runs; the table says how many did)"),
        batch_size: Optional[int] = typer.Option(None, min=1, max=256, help="batched speculative decoding: N rows "
                                                 "per forward over all the prompts (with --compare: vs HF batched AR "
                                                 "and our single-row decoder)"),
        prompts: Optional[Path] = typer.Option(None, help="prompts instead of the recipe's suite: a JSONL file "
                                               "({\"prompt\": ...} or {\"messages\": [...]} per line), or a prompt "
                                               "suite (shipped name, e.g. short-heldout, or YAML); one request at "
                                               "a time unless --batch-size"),
        target: Optional[str] = typer.Option(None, help=TARGET_HELP),
        draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
        out: Path = typer.Option(Path("results/run"), help="directory for the results JSON and Markdown")):
    """Run RECIPE over its prompt suite; print a Markdown table and write results JSON."""
    from eval.run import markdown_table, run_recipe, write_results
    from toolkit.measure.prompts import load_suite

    _check_out(out)
    loaded = _retarget(_load(recipe), target, draft)
    if max_new_tokens is not None:
        loaded = loaded.replace(generation=dataclasses.replace(loaded.generation, max_new_tokens=max_new_tokens))
    if batch_size is not None or loaded.batch_size is not None:
        _run_batch(loaded, batch_size or loaded.rows_per_forward, prompts, compare, repeats, num_prompts, out,
                   time_budget)
        return
    # --prompts alone: the same one-request-at-a-time run (and --compare baselines) over other prompts
    suite = None if prompts is None else load_suite(str(prompts))
    results = run_recipe(loaded, compare=compare, repeats=repeats, prompts=suite, num_prompts=num_prompts,
                         time_budget_s=time_budget)
    path = write_results(results, out, prompts.stem if prompts is not None else "")
    typer.echo(markdown_table(results))
    typer.echo(f"results: {path}")


def _run_batch(recipe, batch_size: int, prompt_file: Optional[Path], compare: bool, repeats: int,
               num_prompts: Optional[int], out: Path, time_budget: Optional[float] = None) -> None:
    """``toolkit run --batch-size`` (or a recipe with ``batch_size``), over ``--prompts`` where given: see
    :mod:`eval.batch_run`."""
    import toolkit
    from eval.batch_run import markdown, run_batch, write_batch_results
    from toolkit.measure.harness import spread
    from toolkit.measure.prompts import load_suite

    # the recipe's suite, or the one --prompts names (JSONL of prompts, a suite YAML or a shipped suite name)
    suite = str(prompt_file) if prompt_file is not None else recipe.prompts
    texts = [p.prompt for p in spread(load_suite(suite), num_prompts)]
    import time

    generator = toolkit.build(recipe)
    deadline = time.monotonic() + time_budget if time_budget else None
    result = run_batch(generator, texts, batch_size, compare=compare, repeats=repeats if compare else 1,
                       progress=True, deadline=deadline)
    result["prompts_source"] = (prompt_file if prompt_file is not None else Path(recipe.prompts)).stem
    path = write_batch_results(result, out)
    typer.echo(markdown(result))
    typer.echo(f"results: {path}")


@app.command()
@reported
def generate(prompt: str = typer.Argument(..., help="prompt text ('-' reads stdin)"),
             recipe: Optional[str] = typer.Option(None, help="recipe YAML file or shipped name (default: short)"),
             chat: bool = typer.Option(True, help="wrap the prompt as a user message with the chat template"),
             max_new_tokens: Optional[int] = typer.Option(None, min=1),
             do_sample: Optional[bool] = typer.Option(None, "--do-sample/--greedy"),
             temperature: Optional[float] = typer.Option(None),
             stream: bool = typer.Option(True, help="print text as tokens commit"),
             target: Optional[str] = typer.Option(None, help=TARGET_HELP),
             draft: Optional[str] = typer.Option(None, help=DRAFT_HELP)):
    """Generate one completion and print it, followed by the round statistics."""
    import toolkit

    text = sys.stdin.read() if prompt == "-" else prompt
    overrides = {k: v for k, v in {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                                   "temperature": temperature}.items() if v is not None}
    loaded = _retarget(_load(recipe or "short"), target, draft)
    loaded = dataclasses.replace(loaded, generation=dataclasses.replace(loaded.generation, **overrides))
    loaded.generation.validate("generation")  # a bad option fails here, before any model loads
    generator = toolkit.build(loaded)
    draft_engine = generator.draft_engine
    if generator.engine.compiled or (draft_engine is not None and draft_engine.compiled):  # say why the wait
        typer.secho(f"decoding path: {generator.engine_note}; its graphs compile at first use (seconds from the "
                    "on-disk cache, a minute or two the first time on this machine)", err=True, fg="cyan")
    message = [{"role": "user", "content": text}] if chat else text
    if stream:
        from toolkit.speculative.stats import GenerationStats

        s = GenerationStats()
        for piece in generator.generate_stream(message, stats=s):
            typer.echo(piece, nl=False)
        typer.echo()
    else:
        result = generator.generate(message)
        typer.echo(result.text)
        s = result.stats
    typer.secho(f"{s.new_tokens} tokens, {s.throughput:.1f} tok/s, α {s.acceptance_rate:.2f}, "
                f"τ {s.tokens_per_round:.2f}, TTFT {s.ttft_ms:.0f} ms"
                + (f" (after compiling for {s.compile_ms / 1000:.1f} s)" if s.compile_ms else ""), err=True, fg="cyan")


@app.command("eval")
@reported
def eval_(recipe: str = typer.Argument(..., help="recipe YAML file or shipped recipe name"),
          force: bool = typer.Option(False, "--force", help="recompute even if results exist"),
          fast: bool = typer.Option(False, "--fast", help="fewer prompts, tokens and repetitions, within a time "
                                    "budget (default 150 s)"),
          time_budget: Optional[float] = typer.Option(None, min=1, help="seconds for the measurement (model loading "
                                                      "excluded): the protocol is cut to fit, the report says what "
                                                      "was cut"),
          target: Optional[str] = typer.Option(None, help=TARGET_HELP),
          draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
          out: Path = typer.Option(Path("results"), help="directory under which results/<name>-<hash>/ is written")):
    """Evaluate RECIPE: perplexity, acceptance, memory, latency, fidelity, baselines (results/<name>-<hash>/)."""
    from eval.cli import eval_command

    eval_command(_retarget(_load(recipe), target, draft), force=force, fast=fast, results_root=_check_out(out),
                 time_budget_s=time_budget)


@app.command()
@reported
def search(scenario: str = typer.Option(..., help="short, long, memory or throughput"),
           budget_mb: Optional[float] = typer.Option(None, help="memory budget in MiB: weights + peak KV (memory and "
                                                     "throughput scenarios)"),
           min_rouge_l: Optional[float] = typer.Option(None, help="bound output quality: mean ROUGE-L F1 of a "
                                                       "recipe's text vs the fp32 AR reference text on the "
                                                       "summarization prompts, in [0, 1]"),
           trials: Optional[int] = typer.Option(None, min=1, help="completed trials the study should reach"),
           timeout: Optional[float] = typer.Option(None, min=1, help="wall-clock budget of this run in seconds "
                                                   "(default: the space file's timeout_s, <= 30 min)"),
           out: Path = typer.Option(Path("found"), help="output directory (found recipe, Pareto plot, study)"),
           storage: Optional[str] = typer.Option(None, help="Optuna storage URL, e.g. postgresql://user@host/db "
                                                 "(default: a SQLite file under --out)"),
           workers: int = typer.Option(1, min=1, max=64, help="worker processes on this study"),
           study_name: Optional[str] = typer.Option(None, help="study name (default search-<scenario>)"),
           space: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help="search space YAML "
                                                "(default recipes/search/<scenario>.yaml)"),
           enable: list[str] = typer.Option([], help="search a dimension or label kept off in the space file "
                                            "(drafter.suffix, target_backend); repeatable"),
           finalize: bool = typer.Option(True, "--finalize/--no-finalize", help="choose, confirm and write the "
                                         "winner when done (extra workers started elsewhere: --no-finalize)"),
           heartbeat: Optional[float] = typer.Option(None, hidden=True, help="heartbeat interval (s)"),
           target: Optional[str] = typer.Option(None, help="search for your model: a local HF directory or a .gguf "
                                                "file (the space adapts: no embedded-only EAGLE head, KV groups "
                                                "that divide its head dimension)"),
           draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
           prompts: Optional[str] = typer.Option(None, help="the trials' prompts: a JSONL file ({\"prompt\": ...} or "
                                                 "{\"messages\": [...]} per line), a suite YAML or a shipped suite")):
    """Search the configuration space of SCENARIO; writes <out>/<scenario>.yaml and a Pareto plot."""
    from eval.cli import search_command

    search_command(scenario, budget_mb=budget_mb, trials=trials, storage=storage, timeout=timeout,
                   out=_check_out(out), workers=workers, study_name=study_name, space=space, enable=enable,
                   finalize_results=finalize, heartbeat_s=heartbeat, target=target, draft=draft,
                   prompt_suite=prompts, min_rouge_l=min_rouge_l)


def _register_distill() -> None:
    """``toolkit draft distill``: every option of :func:`toolkit_cli.distill.distill_command` (see there)."""
    from toolkit_cli.distill import distill_command

    draft_app.command("distill", help="Train a small draft for a target by knowledge distillation (KL at τ).")(
        distill_command)


_register_distill()


def _register_eagle() -> None:
    """``toolkit draft eagle``: every option of :func:`toolkit_cli.eagle.eagle_command` (see there)."""
    from toolkit_cli.eagle import eagle_command

    draft_app.command("eagle", help="Train an EAGLE feature-level draft head for a target.")(eagle_command)


_register_eagle()


def _register_export_head() -> None:
    """``toolkit draft export-head``: :func:`toolkit_cli.export_head.export_head_command` (see there)."""
    from toolkit_cli.export_head import export_head_command

    draft_app.command("export-head", help="Write an EAGLE head in the speculators (vLLM) or EAGLE (vLLM / SGLang) "
                      "layout.")(export_head_command)


_register_export_head()


def configure_logging() -> None:
    """The command's logging: WARNING and up from every logger, plus the INFO lines of ``toolkit.quant`` (the one line
    per process naming the kernel that runs quantized weights). The library sets no levels itself; this does."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("toolkit.quant").setLevel(logging.INFO)


def main() -> None:
    configure_logging()
    app()


if __name__ == "__main__":
    main()
