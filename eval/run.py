"""``toolkit run RECIPE [--compare]``: run a recipe over its prompt suite, print a Markdown table, write JSON.

With ``--compare`` the same prompts also run, on the same model objects and precision, through HF ``generate``
(autoregressive), HF assisted generation with the same pair and constant K (for model drafters) and HF prompt lookup
(for the n-gram drafter), all timed by :func:`toolkit.harness.measure` (warm-up, interleaved repetitions, medians
with min-max). Greedy runs also report whether each method's text is identical to AR greedy.

Results are a :class:`RunResult`; ``to_dict()`` is the on-disk JSON contract (``results/run/<name>-<hash>.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eval.runners import OURS, baseline_methods, runners_for
from toolkit.generator import Generator, build
from toolkit.harness import Measurement, Prompt, environment, measure, spread
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.prompts import Prompt as SuitePrompt
from toolkit.prompts import load_suite
from toolkit.recipe import Recipe
from toolkit.speculative.stats import acceptance_summary
from toolkit.timing import Summary


@dataclass
class Row:
    """One method on one prompt: medians over repetitions, counters of the last repetition."""

    prompt: str
    method: str
    new_tokens: int
    throughput: Summary
    ttft_ms: Summary
    tpot_ms: Summary
    total_ms: Summary
    acceptance_rate: float | None
    tokens_per_round: float
    rounds: int
    target_forwards: int
    draft_forwards: int
    kv_bytes_target: int
    kv_bytes_draft: int
    compressions: int
    finish_reason: str
    identical_to_ar: bool | None
    text: str
    accepted_at: list[int] | None = None
    drafted_at: list[int] | None = None

    def to_dict(self) -> dict:
        data = {k: (v.to_dict() if isinstance(v, Summary) else v) for k, v in self.__dict__.items()}
        if self.accepted_at is None:
            data.pop("accepted_at")
            data.pop("drafted_at")
        return data


@dataclass
class RunResult:
    """What ``toolkit run`` measured: per-prompt rows, a per-method summary, the environment."""

    recipe: Recipe
    compare: bool
    weight_bytes: dict
    rows: list[Row]
    summary: dict[str, dict]
    environment: dict = field(default_factory=environment)

    def speedup(self, baseline: str) -> float | None:
        """Our throughput over ``baseline``'s (tokens over the sum of per-prompt median times)."""
        return self.summary[OURS].get(f"speedup_vs_{baseline}")

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "config_hash": self.recipe.config_hash(), "compare": self.compare,
                "weight_bytes": self.weight_bytes, "summary": self.summary,
                "rows": [r.to_dict() for r in self.rows], "environment": self.environment}


def run_recipe(recipe: Recipe, compare: bool = False, repeats: int = 3, prompts: list[SuitePrompt] | None = None,
               generator: Generator | None = None, progress: bool = True, num_prompts: int | None = None,
               ) -> RunResult:
    """Run ``recipe`` (and, with ``compare``, its HF baselines) over its prompt suite (``num_prompts`` of them,
    spread over the suite's kinds, or all)."""
    prompts = prompts if prompts is not None else load_suite(recipe.prompts)  # fail fast, before loading models
    prompts = spread(prompts, num_prompts)
    generator = generator or build(recipe)
    gen = recipe.generation
    eos = generator.eos_token_ids(gen)
    methods = [OURS] + (baseline_methods(recipe) if compare else [])
    items = [Prompt(p.id, p.kind, generator.encode(p.prompt)) for p in prompts]
    measured = measure(runners_for(generator, methods, eos), items, gen, repeats=repeats if compare else 1,
                       warmup=1, progress=progress, desc=f"run {recipe.name}")
    return _result(recipe, generator, measured, compare)


def _result(recipe: Recipe, generator: Generator, measured: Measurement, compare: bool) -> RunResult:
    ar_ids = {p.id: c.token_ids for p, c in zip(measured.prompts, measured.last("ar"))} if "ar" in measured.calls \
        else {}
    rows = []
    for i, prompt in enumerate(measured.prompts):
        for method in measured.methods:
            calls = measured.per_prompt(method, i)
            last = calls[-1].stats

            def summary(attr: str) -> Summary:
                return Summary.of([getattr(c.stats, attr) for c in calls])  # noqa: B023 (used immediately)

            ids = calls[-1].token_ids
            ours = method == OURS
            rows.append(Row(
                prompt.id, method, last.new_tokens, summary("throughput"), summary("ttft_ms"), summary("tpot_ms"),
                summary("total_ms"), last.acceptance_rate if ours else None, last.tokens_per_round, last.rounds,
                last.target_forwards, last.draft_forwards, last.kv_bytes_target, last.kv_bytes_draft,
                last.compressions_target + last.compressions_draft, last.finish_reason,
                (ids == ar_ids[prompt.id]) if prompt.id in ar_ids else None,
                generator.tokenizer.decode(ids, skip_special_tokens=True),
                last.accepted_at if ours else None, last.drafted_at if ours else None))
    summary = {}
    for method in measured.methods:
        mine = [r for r in rows if r.method == method]
        tokens = sum(r.new_tokens for r in mine)
        seconds = sum(r.total_ms.median for r in mine) / 1000
        summary[method] = {"new_tokens": tokens, "throughput": tokens / seconds if seconds else 0.0}
    ours = summary[OURS]["throughput"]
    for method in measured.methods:
        if method != OURS and summary[method]["throughput"]:
            summary[OURS][f"speedup_vs_{method}"] = ours / summary[method]["throughput"]
    acc = acceptance_summary([c.stats for c in measured.last(OURS)])
    summary[OURS]["acceptance_rate"] = acc["acceptance_rate"]
    summary[OURS]["tokens_per_round"] = acc["tokens_per_round"]
    if compare and not recipe.generation.do_sample:
        summary[OURS]["identical_to_ar"] = all(r.identical_to_ar for r in rows if r.method == OURS)
    return RunResult(recipe, compare, generator.weight_bytes, rows, summary)


def markdown_table(results: RunResult | dict) -> str:
    """The per-prompt table and the summary, as Markdown (from a result or its ``to_dict()``)."""
    if isinstance(results, RunResult):
        results = results.to_dict()

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


def write_results(results: RunResult, out_dir: Path = Path("results/run")) -> Path:
    """Write ``<name>-<hash>.json`` and ``.md`` atomically under ``out_dir``; returns the JSON path."""
    data = results.to_dict()
    path = Path(out_dir) / f"{data['recipe']['name']}-{data['config_hash']}.json"
    atomic_write_json(path, data)
    atomic_write_text(path.with_suffix(".md"), markdown_table(data))
    return path
