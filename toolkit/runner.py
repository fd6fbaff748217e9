"""``toolkit run RECIPE [--compare]``: run a recipe over its prompt suite, print a Markdown table, write JSON.

With ``--compare`` the same prompts also run, on the same model objects and precision, through HF ``generate``
(autoregressive), HF assisted generation with the same pair and constant K (for model drafters) and HF prompt lookup
(for the n-gram drafter). Every method is warmed up once, then timed ``repeats`` times per prompt; the table shows
medians with min-max, and a summary gives throughput ratios measured in this one process. Greedy runs also report
whether each method's text is identical to AR greedy.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from pathlib import Path

import torch

from toolkit.baselines import hf_generate
from toolkit.generator import Generator, build
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.prompts import Prompt, load_suite
from toolkit.recipe import Recipe
from toolkit.speculative.stats import GenerationStats
from toolkit.timing import Summary

OURS = "ours"


@dataclasses.dataclass
class MethodRun:
    """One method on one prompt: its output ids (of the last repetition) and the stats of every repetition."""

    method: str
    prompt_id: str
    token_ids: list[int]
    runs: list[GenerationStats]

    def summary(self, attr: str) -> Summary:
        return Summary.of([getattr(s, attr) for s in self.runs])


def baseline_methods(recipe: Recipe) -> list[str]:
    """The HF baselines that make sense next to this recipe's drafter."""
    methods = ["ar"]
    if recipe.spec.drafter in ("draft_model", "self"):
        methods.append("assisted")
    if recipe.spec.drafter in ("ngram", "suffix"):  # model-free drafters: HF prompt lookup
        methods.append("prompt_lookup")
    return methods


def _run_method(generator: Generator, method: str, prompt: Prompt, repeats: int) -> MethodRun:
    recipe = generator.recipe
    gen = recipe.generation
    input_ids = generator.encode(prompt.prompt)
    eos = generator.eos_token_ids(gen)
    runs, ids = [], []
    for _ in range(repeats):
        if method == OURS:
            result = generator.generate(prompt.prompt)
            ids, stats = result.token_ids, result.stats
        else:
            ids, stats = hf_generate(generator.target, input_ids, gen, eos, method=method,
                                     assistant_model=generator.draft_model,
                                     num_draft_tokens=recipe.spec.num_draft_tokens, max_ngram=recipe.spec.max_ngram)
        runs.append(stats)
    return MethodRun(method, prompt.id, ids, runs)


def run_recipe(recipe: Recipe, compare: bool = False, repeats: int = 3, prompts: list[Prompt] | None = None,
               generator: Generator | None = None, progress: bool = True) -> dict:
    """Run ``recipe`` (and, with ``compare``, its HF baselines) over its prompt suite; returns the results dict."""
    from tqdm.auto import tqdm

    prompts = prompts if prompts is not None else load_suite(recipe.prompts)  # fail fast, before loading models
    generator = generator or build(recipe)
    methods = [OURS] + (baseline_methods(recipe) if compare else [])
    for method in methods:  # one warm-up per method (allocator, kernels, lazy init), not timed
        _run_method(generator, method, prompts[0], 1)
    results: list[MethodRun] = []
    bar = tqdm(total=len(prompts) * len(methods), desc=f"run {recipe.name}", unit="gen", disable=not progress)
    for prompt in prompts:
        for method in methods:
            bar.set_postfix_str(f"{prompt.id} / {method}")
            results.append(_run_method(generator, method, prompt, repeats if compare else 1))
            bar.update()
    bar.close()
    return _results_dict(recipe, generator, prompts, methods, results, compare)


def _results_dict(recipe, generator, prompts, methods, results, compare) -> dict:
    ar_ids = {r.prompt_id: r.token_ids for r in results if r.method == "ar"}
    rows = []
    for r in results:
        last = r.runs[-1]
        row = {
            "prompt": r.prompt_id, "method": r.method, "new_tokens": last.new_tokens,
            "throughput": r.summary("throughput").to_dict(), "ttft_ms": r.summary("ttft_ms").to_dict(),
            "tpot_ms": r.summary("tpot_ms").to_dict(), "total_ms": r.summary("total_ms").to_dict(),
            "acceptance_rate": last.acceptance_rate if r.method == OURS else None,
            "tokens_per_round": last.tokens_per_round, "rounds": last.rounds,
            "target_forwards": last.target_forwards, "draft_forwards": last.draft_forwards,
            "kv_bytes_target": last.kv_bytes_target, "kv_bytes_draft": last.kv_bytes_draft,
            "compressions": last.compressions_target + last.compressions_draft,
            "finish_reason": last.finish_reason,
            "identical_to_ar": (r.token_ids == ar_ids[r.prompt_id]) if r.prompt_id in ar_ids else None,
            "text": generator.tokenizer.decode(r.token_ids, skip_special_tokens=True),
        }
        if r.method == OURS:
            row["accepted_at"], row["drafted_at"] = last.accepted_at, last.drafted_at
        rows.append(row)
    summary = {}
    for method in methods:
        mine = [r for r in results if r.method == method]
        tokens = sum(r.runs[-1].new_tokens for r in mine)
        seconds = sum(r.summary("total_ms").median for r in mine) / 1000
        summary[method] = {"new_tokens": tokens, "throughput": tokens / seconds if seconds else 0.0}
    ours = summary[OURS]["throughput"]
    for method in methods:
        if method != OURS and summary[method]["throughput"]:
            summary[OURS][f"speedup_vs_{method}"] = ours / summary[method]["throughput"]
    our_stats = [r.runs[-1] for r in results if r.method == OURS]
    drafted, accepted = sum(s.drafted for s in our_stats), sum(s.accepted for s in our_stats)
    rounds, committed = sum(s.rounds for s in our_stats), sum(s.committed for s in our_stats)
    summary[OURS]["acceptance_rate"] = accepted / drafted if drafted else 0.0
    summary[OURS]["tokens_per_round"] = committed / rounds if rounds else 0.0
    if compare and not recipe.generation.do_sample:
        summary[OURS]["identical_to_ar"] = all(r["identical_to_ar"] for r in rows if r["method"] == OURS)
    return {
        "recipe": recipe.to_dict(), "config_hash": recipe.config_hash(), "compare": compare,
        "weight_bytes": generator.weight_bytes, "summary": summary, "rows": rows,
        "environment": environment(),
    }


def environment() -> dict:
    """Hardware and library versions, recorded with every result (runs, evaluations, found recipes)."""
    import os

    import transformers

    try:
        cpu_count = len(os.sched_getaffinity(0))
    except AttributeError:
        cpu_count = os.cpu_count() or 1
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "machine": platform.machine(), "cpu_count": cpu_count,
            "torch_threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import bitsandbytes

        info["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["hardware"] = info.get("gpu") or f"{platform.processor() or platform.machine()} CPU x{cpu_count}"
    return info


def markdown_table(results: dict) -> str:
    """The per-prompt table and the summary, as Markdown."""
    def fmt_bytes(n):
        return f"{n / 2**20:.1f} MiB" if n else "-"

    lines = [f"## {results['recipe']['name']} ({results['config_hash']})", "",
             "| prompt | method | new tok | tok/s median [min-max] | TTFT ms | TPOT ms | α | τ | KV target | "
             "= AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        thr = row["throughput"]
        alpha = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
        same = {True: "yes", False: "NO", None: "-"}[row["identical_to_ar"]]
        lines.append(f"| {row['prompt']} | {row['method']} | {row['new_tokens']} | {thr['median']:.1f} "
                     f"[{thr['min']:.1f}-{thr['max']:.1f}] | {row['ttft_ms']['median']:.0f} | "
                     f"{row['tpot_ms']['median']:.1f} | {alpha} | {row['tokens_per_round']:.2f} | "
                     f"{fmt_bytes(row['kv_bytes_target'])} | {same} |")
    lines += ["", "| method | new tokens | throughput tok/s | notes |", "|---|---|---|---|"]
    for method, s in results["summary"].items():
        notes = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in s.items() if k not in ("new_tokens", "throughput"))
        lines.append(f"| {method} | {s['new_tokens']} | {s['throughput']:.1f} | {notes} |")
    wb = results["weight_bytes"]
    if results["recipe"]["kv"]["policy"] != "none":
        lines += ["", "(= AR compares with uncompressed HF AR greedy; under a KV policy the text may legitimately "
                  "differ — window-exactness against AR under the same policy is a test, not this column.)"]
    lines += ["", f"weights: target {fmt_bytes(wb['target'])}, draft {fmt_bytes(wb['draft'])}; "
              f"device: {results['environment']['hardware']} ({results['environment']['torch_threads']} torch threads)"]
    return "\n".join(lines) + "\n"


def write_results(results: dict, out_dir: Path = Path("results/run")) -> Path:
    """Write ``<name>-<hash>.json`` and ``.md`` atomically; returns the JSON path."""
    stem = f"{results['recipe']['name']}-{results['config_hash']}"
    path = Path(out_dir) / f"{stem}.json"
    atomic_write_json(path, results)
    atomic_write_text(path.with_suffix(".md"), markdown_table(results))
    return path
