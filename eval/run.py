"""``toolkit run RECIPE [--compare]``: run a recipe over its prompt suite, print a Markdown table, write JSON.

With ``--compare`` the same prompts also run, on the same model objects and precision, through HF ``generate``
(autoregressive, eager and with HF's static cache + compile), HF assisted generation with the same pair and constant K
(for model drafters) and HF prompt lookup (for the n-gram drafter), and through the CPU engines installed
(llama.cpp on the same GGUF, OpenVINO int4: :mod:`toolkit.measure.engines`), all timed by
:func:`toolkit.measure.harness.measure` (warm-up, interleaved repetitions, medians with min-max). Greedy runs also
report whether each method's text is identical to AR greedy.

Results are a :class:`RunResult`; ``to_dict()`` is the on-disk JSON contract (``results/run/<name>-<hash>.json``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eval.fidelity import agreement, first_divergence
from eval.runners import (
    OURS,
    OURS_LLAMACPP,
    PROMPT_LOOKUPS,
    baseline_methods,
    engine_runners,
    llamacpp_hint,
    runners_for,
    static_cache_len,
    strongest_baselines,
)
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.measure.engines import ENGINES
from toolkit.measure.harness import Measurement, Prompt, environment, measure, spread
from toolkit.measure.prompts import Prompt as SuitePrompt
from toolkit.measure.prompts import load_suite
from toolkit.measure.timing import Summary
from toolkit.recipe import Recipe
from toolkit.session import SHARED_POOL
from toolkit.speculative.stats import acceptance_summary, round_summary
from toolkit.speculative_lm import SpeculativeLM, build


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
    round_ms: dict | None = None
    plain_steps: int = 0
    divergence: dict | None = None

    def to_dict(self) -> dict:
        data = {k: (v.to_dict() if isinstance(v, Summary) else v) for k, v in self.__dict__.items()}
        if self.accepted_at is None:
            for key in ("accepted_at", "drafted_at", "round_ms", "plain_steps"):
                data.pop(key)
        if self.divergence is None:
            data.pop("divergence")
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
    repeats_done: int = 1  # timed repetitions that ran (fewer than asked when a time budget ended them)
    engine: dict = field(default_factory=dict)  # {"path": the decoding path and why, "compile_s": seconds}
    weights: dict = field(default_factory=dict)  # {"target": which weights it runs, in words, "draft": ...}

    def speedup(self, baseline: str) -> float | None:
        """Our throughput over ``baseline``'s (tokens over the sum of per-prompt median times)."""
        return self.summary[OURS].get(f"speedup_vs_{baseline}")

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "config_hash": self.recipe.config_hash(), "compare": self.compare,
                "weight_bytes": self.weight_bytes, "summary": self.summary,
                "rows": [r.to_dict() for r in self.rows], "repeats_done": self.repeats_done, "engine": self.engine,
                "weights": self.weights, "environment": self.environment}


def run_recipe(recipe: Recipe, compare: bool = False, repeats: int = 3, prompts: list[SuitePrompt] | None = None,
               generator: SpeculativeLM | None = None, progress: bool = True, num_prompts: int | None = None,
               time_budget_s: float | None = None) -> RunResult:
    """Run ``recipe`` (and, with ``compare``, its HF baselines) over its prompt suite (``num_prompts`` of them,
    spread over the suite's kinds, or all).

    Before timing, the work is estimated from the target's verify cost curve and logged (``progress``); with
    ``time_budget_s`` no repetition starts that would end past the budget (at least one runs; the result's
    ``repeats_done`` says how many did)."""
    prompts = prompts if prompts is not None else load_suite(recipe.prompts)  # fail fast, before loading models
    prompts = spread(prompts, num_prompts)
    generator = generator or build(recipe, pool=SHARED_POOL)
    gen = recipe.generation
    eos = generator.eos_token_ids(gen)
    reference = None
    if compare and recipe.target.precision != "fp32":  # fp32 AR next to a low-precision target, for reference
        fp32 = dataclasses.replace(recipe.target, precision="fp32", backend="auto")  # llama.cpp targets: on torch
        reference, _ = SHARED_POOL.get(fp32, "reference")
    methods = [OURS] + (baseline_methods(recipe, reference is not None) if compare else [])
    if compare:  # the strongest baselines right after plain HF AR
        methods[2:2] = strongest_baselines(recipe, generator.target)
        hint = llamacpp_hint(recipe, methods, generator.target)
        if hint and progress:
            print(hint, file=sys.stderr)
    items = [Prompt(p.id, p.kind, generator.encode(p.prompt, f"prompts.{p.id}")) for p in prompts]
    for item in items:  # before any forward: empty prompts, prompts past the context, EOS ids outside the vocab
        generator.check_request(item.input_ids, gen, f"prompts.{item.id}")
    started = time.monotonic()
    if progress:
        from eval.budget import forward_ms, timing_s

        n = repeats if compare else 1
        ms = forward_ms(generator.verify_cost)
        estimate = timing_s([int(i.input_ids.shape[1]) for i in items], len(methods), gen.max_new_tokens, n, 1, ms)
        print(f"run {recipe.name}: {len(methods)} method(s) x {len(items)} prompt(s) x {n} repetition(s) of "
              f"{gen.max_new_tokens} tokens: about {estimate:.0f} s on this machine (estimated from the target's "
              f"cost curve){f'; time budget {time_budget_s:.0f} s' if time_budget_s else ''}", file=sys.stderr)
    # every repetition starts from the same drafter state: memory across requests holds only the earlier prompts of
    # the same repetition, never an earlier repetition of the same prompt
    engine = _compile_first(generator, items, gen.max_new_tokens, progress)
    static_len = static_cache_len([int(i.input_ids.shape[1]) for i in items], gen.max_new_tokens)
    with engine_runners(recipe, methods, eos) as engine_calls:
        runners = runners_for(generator, methods, eos, reference, static_cache_len=static_len,
                              engine_calls=engine_calls)
        generators = [generator] + [r.generator for r in runners.values() if hasattr(r, "generator")]
        measured = measure(runners, items, gen, repeats=repeats if compare else 1, warmup=1, progress=progress,
                           desc=f"run {recipe.name}",
                           warm_gen=dataclasses.replace(gen, max_new_tokens=min(16, gen.max_new_tokens)),
                           before_repetition=lambda rep: [g.forget() for g in generators],
                           deadline=started + time_budget_s if time_budget_s else None)
    result = _result(recipe, generator, measured, compare)
    result.engine = engine
    return result


def _compile_first(generator: SpeculativeLM, items: list[Prompt], max_new_tokens: int, progress: bool) -> dict:
    """Compile the engine's graphs for these requests before any timed call; what path decoding takes."""
    seconds = generator.warm_up(max(int(i.input_ids.shape[1]) for i in items) + max_new_tokens)
    if progress:
        print(f"decoding path: {generator.engine_note}" + (f"; compiled in {seconds:.0f} s" if seconds else ""),
              file=sys.stderr)
    return {"path": generator.engine_note, "compile_s": round(seconds, 1)}


def _result(recipe: Recipe, generator: SpeculativeLM, measured: Measurement, compare: bool) -> RunResult:
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
            same = (ids == ar_ids[prompt.id]) if prompt.id in ar_ids else None
            divergence = None
            if method in ENGINES or method == OURS_LLAMACPP:  # other kernels / weights: not the target's text
                same = None
            if same is False and method != "ar_fp32" and not recipe.generation.do_sample:
                divergence = first_divergence(generator.target, prompt.input_ids, ar_ids[prompt.id], ids)
            rows.append(Row(
                prompt.id, method, last.new_tokens, summary("throughput"), summary("ttft_ms"), summary("tpot_ms"),
                summary("total_ms"), last.acceptance_rate if ours else None, last.tokens_per_round, last.rounds,
                last.target_forwards, last.draft_forwards, last.kv_bytes_target, last.kv_bytes_draft,
                last.compressions_target + last.compressions_draft, last.finish_reason, same,
                generator.tokenizer.decode(ids, skip_special_tokens=True),
                last.accepted_at if ours else None, last.drafted_at if ours else None,
                round_summary([c.stats for c in calls]) if ours else None, last.plain_steps, divergence))
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
    lookups = [summary[m]["throughput"] for m in PROMPT_LOOKUPS if m in summary]
    if lookups and max(lookups):
        summary[OURS]["speedup_vs_best_prompt_lookup"] = ours / max(lookups)
    acc = acceptance_summary([c.stats for c in measured.last(OURS)])
    summary[OURS]["acceptance_rate"] = acc["acceptance_rate"]
    summary[OURS]["tokens_per_round"] = acc["tokens_per_round"]
    summary[OURS]["round_ms"] = round_summary([c.stats for rep in measured.calls[OURS] for c in rep])
    if compare and not recipe.generation.do_sample:
        mine = [r for r in rows if r.method == OURS]
        summary[OURS]["identical_to_ar"] = all(r.identical_to_ar for r in mine)
        summary[OURS]["agreement"] = agreement([{"identical": r.identical_to_ar, "divergence": r.divergence}
                                                 for r in mine])
    return RunResult(recipe, compare, generator.weight_bytes, rows, summary,
                     repeats_done=len(measured.calls[measured.methods[0]]), weights=dict(generator.weights))


def markdown_table(results: RunResult | dict) -> str:
    """The per-prompt table and the summary, as Markdown (from a result or its ``to_dict()``)."""
    if isinstance(results, RunResult):
        results = results.to_dict()

    def fmt_bytes(n):
        return f"{n / 2**20:.1f} MiB" if n else "-"

    lines = [f"## {results['recipe']['name']} ({results['config_hash']})", "",
             "| prompt | method | new tok | tok/s median [min-max] | TTFT ms | TPOT ms | α | τ | ms/round draft + "
             "verify + overhead | overhead % | KV target | = AR |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        thr = row["throughput"]
        alpha = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
        same = {True: "yes", False: "NO", None: "-"}[row["identical_to_ar"]]
        if row.get("divergence"):
            same = f"no: token {row['divergence']['index']}, margin {row['divergence']['margin']:.2f}"
        rms = row.get("round_ms")
        split = f"{rms['draft']:.1f} + {rms['target']:.1f} + {rms['overhead']:.1f}" if rms else "-"
        share = f"{rms['overhead_pct']:.1f}" if rms else "-"
        lines.append(f"| {row['prompt']} | {row['method']} | {row['new_tokens']} | {thr['median']:.1f} "
                     f"[{thr['min']:.1f}-{thr['max']:.1f}] | {row['ttft_ms']['median']:.0f} | "
                     f"{row['tpot_ms']['median']:.1f} | {alpha} | {row['tokens_per_round']:.2f} | {split} | {share} | "
                     f"{fmt_bytes(row['kv_bytes_target'])} | {same} |")
    lines += ["", "| method | new tokens | throughput tok/s | notes |", "|---|---|---|---|"]
    for method, s in results["summary"].items():
        notes = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in s.items() if k not in ("new_tokens", "throughput", "round_ms", "agreement"))
        if s.get("agreement"):
            a = s["agreement"]
            notes += (f", identical to AR on {a['identical']}/{a['prompts']} prompts ({100 * a['matched_fraction']:.0f}% "
                      "of tokens before a divergence" + (f"; largest margin at a divergence "
                                                        f"{a['max_divergence_margin']:.2f} logits" if
                                                        a["max_divergence_margin"] is not None else "") + ")")
        if "round_ms" in s:
            r = s["round_ms"]
            notes += (f", ms/round: draft {r['draft']:.2f} + verify {r['target']:.1f} + overhead {r['overhead']:.2f} "
                      f"({r['overhead_pct']:.1f}%)")
        lines.append(f"| {method} | {s['new_tokens']} | {s['throughput']:.1f} | {notes} |")
    wb = results["weight_bytes"]
    if results["recipe"]["kv"]["policy"] != "none":
        lines += ["", "(= AR compares with uncompressed HF AR greedy; under a KV policy the text may legitimately "
                  "differ — window-exactness against AR under the same policy is a test, not this column.)"]
    if results.get("engine"):
        lines += ["", f"decoding path: {results['engine']['path']} (graphs compiled before timing: "
                  f"{results['engine']['compile_s']:.0f} s)"]
    kinds = results.get("weights") or {}  # which weights each model ran, in words
    target_kind = f" ({kinds['target']})" if kinds.get("target") else ""
    draft_kind = f" ({kinds['draft']})" if kinds.get("draft") else ""
    lines += ["", f"weights: target {fmt_bytes(wb['target'])}{target_kind}, draft "
              f"{fmt_bytes(wb['draft'])}{draft_kind}; "
              f"device: {results['environment']['hardware']} ({results['environment']['torch_threads']} torch "
              f"threads); {results.get('repeats_done', 1)} timed repetition(s)"]
    return "\n".join(lines) + "\n"


def result_stem(name: str, config_hash: str, prompts_source: str = "") -> str:
    """``<name>-<hash>[-<prompts_source>]``: a results file's stem; the prompts' source (a file or suite name, empty
    for the recipe's own suite) reduced to file-name characters, so runs over other prompts get files of their own."""
    label = re.sub(r"[^A-Za-z0-9._-]", "_", prompts_source).strip("._")
    return "-".join(part for part in (name, config_hash, label) if part)


def write_results(results: RunResult, out_dir: Path = Path("results/run"), prompts_source: str = "") -> Path:
    """Write ``<name>-<hash>[-<prompts_source>].json`` and ``.md`` atomically under ``out_dir``; returns the JSON
    path. ``prompts_source`` names prompts other than the recipe's suite (``toolkit run --prompts``), so a run over
    them does not overwrite the suite's.

    Raises:
        ConfigError: the recipe's name is not a safe name (the files stay inside ``out_dir``).
    """
    from toolkit.recipe import check_name

    data = results.to_dict()
    stem = result_stem(check_name("name", data["recipe"]["name"]), data["config_hash"], prompts_source)
    path = Path(out_dir) / f"{stem}.json"
    atomic_write_json(path, data)
    atomic_write_text(path.with_suffix(".md"), markdown_table(data))
    return path
