"""Reports of a search: the Pareto table and plot, "why it won", and the found recipe with its provenance.

Found recipes hold no machine paths (local model sources, the SQLite study and results directories are written
relative to the recipe file) and no secrets (storage URLs arrive here without their password).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

from eval.scenarios import DIRECTIONS, OBJECTIVES, Scenario
from eval.search.select import TrialRow, primary_value, verdict
from eval.space import SearchSpace
from toolkit.io import atomic_write_png, atomic_write_text


def _fmt_cons(cons: dict | None) -> str:
    if not cons:
        return "–"
    return ", ".join(f"{k} {'ok' if v <= 0 else f'+{v:.3g}'}" for k, v in cons.items())


def _vs_baseline(summary: dict) -> tuple[str, float | None]:
    """The ratio a trial is read against: HF batched AR at its batch size for a batched recipe (the throughput
    scenario), else AR on the fp32 target (or the recipe's target)."""
    ratios = summary.get("ratios", {})
    if "ours_batch_vs_hf_batch_ar" in ratios:
        return "HF batched AR", ratios["ours_batch_vs_hf_batch_ar"]
    return "AR fp32", ratios.get("ours_vs_ar_fp32", ratios.get("ours_vs_ar"))


def table(rows: list[TrialRow], sc: Scenario, best: TrialRow | None, counts: dict | None = None) -> str:
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    lines = [f"# Search: {sc.name}", "",
             f"Primary objective: {sc.primary}; constraints: {bounds}. Objectives of every trial: throughput "
             "(tok/s, median of the repetitions, up), perplexity (recipe's target through its cache, down), memory "
             "(weights + peak KV of target and draft, exact bytes, MiB, down).", "",
             _counts_line(counts), "",
             "| # | params | tok/s [min–max] | vs AR fp32 (batched: HF batched AR) | PPL (×fp32) "
             "| ROUGE-L vs fp32 AR | memory MiB | KV MiB | α | τ | constraints | feasible | Pareto | chosen |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r.number):
        s = r.summary
        _, ar = _vs_baseline(s)
        lines.append(
            f"| {r.number} | {', '.join(f'{k}={v}' for k, v in r.params.items())} | "
            f"{s['throughput']:.1f} [{s['throughput_min']:.1f}–{s['throughput_max']:.1f}] | "
            f"{'–' if ar is None else f'{ar:.2f}×'} | {s['ppl']:.2f} (×{(s['ppl_ratio'] or float('nan')):.3f}) | "
            f"{'–' if s.get('rouge_l') is None else format(s['rouge_l'], '.3f')} | "
            f"{s['memory_mb']:.1f} | {s['kv_peak_mb']:.1f} | {s['alpha']:.2f} | {s['tau']:.2f} | "
            f"{_fmt_cons(r.constraints)} | {'yes' if r.feasible else 'no'} | {'yes' if r.pareto else ''} | "
            f"{'**yes**' if r.chosen else ''} |")
    lines += ["", f"Winner: trial {best.number}" if best else "No feasible trial: nothing chosen.", ""]
    return "\n".join(lines)


def _counts_line(counts: dict | None) -> str:
    if not counts:
        return ""
    by = ", ".join(f"{k}: {v}" for k, v in sorted(counts.get("invalid_by_field", {}).items()))
    return (f"Trials: {counts['complete']} completed ({counts['reused']} reused an identical earlier evaluation), "
            f"{counts['invalid']} invalid combinations rejected before loading any model{f' ({by})' if by else ''}, "
            f"{counts['duplicate']} duplicates of a running trial skipped, {counts['failed']} failed.")


def plot_trials(rows: list[TrialRow], sc: Scenario, path: Path, counts: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    feas = [r for r in rows if r.feasible]
    infeas = [r for r in rows if not r.feasible]
    if infeas:
        ax.scatter([r.values[2] for r in infeas], [r.values[0] for r in infeas], marker="x", c="gray",
                   label="infeasible")
    if feas:
        sc_ = ax.scatter([r.values[2] for r in feas], [r.values[0] for r in feas],
                         c=[r.values[1] for r in feas], cmap="viridis", label="feasible")
        bar = fig.colorbar(sc_, ax=ax, label="perplexity")
        bar.formatter.set_useOffset(False)
        bar.update_ticks()
    front = sorted([r for r in rows if r.pareto], key=lambda r: r.values[2])
    if front:
        ax.plot([r.values[2] for r in front], [r.values[0] for r in front], "r--", lw=1)
        ax.scatter([r.values[2] for r in front], [r.values[0] for r in front], s=120, facecolors="none",
                   edgecolors="r", label="Pareto front")
    for r in rows:
        ax.annotate(str(r.number), (r.values[2], r.values[0]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
        if r.chosen:
            ax.scatter([r.values[2]], [r.values[0]], marker="*", s=250, c="gold", edgecolors="k",
                       label="chosen", zorder=5)
    ax.set_xlabel("memory: weights + peak KV (MiB)")
    ax.set_ylabel("throughput (tokens/s)")
    extra = f"; {counts['invalid']} invalid not run" if counts and counts.get("invalid") else ""
    ax.set_title(f"Search '{sc.name}': all {len(rows)} measured trials (primary: {sc.primary}{extra})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        atomic_write_png(path, fig)
    finally:
        plt.close(fig)


def _fmt_primary(value: float, sc: Scenario) -> str:
    return {"throughput": f"{value:.2f} tok/s", "ppl": f"PPL {value:.3f}", "memory_mb": f"{value:.2f} MiB"}[sc.primary]


def _why(best: TrialRow, rows: list[TrialRow], sc: Scenario) -> str:
    s = best.summary
    feasible = [r for r in rows if r.feasible]
    others = sorted((r for r in feasible if r is not best),
                    key=lambda r: r.values[OBJECTIVES.index(sc.primary)],
                    reverse=DIRECTIONS[OBJECTIVES.index(sc.primary)] == "maximize")
    baseline, ar = _vs_baseline(s)
    if sc.primary == "throughput":
        head = f"highest throughput ({s['throughput']:.1f} tok/s{f', {ar:.2f}x {baseline}' if ar else ''})"
    elif sc.primary == "memory_mb":
        head = f"least memory ({s['memory_mb']:.1f} MiB weights + peak KV)"
    else:
        head = f"lowest perplexity ({s['ppl']:.2f})"
    line = (f"{head} among {len(feasible)} feasible of {len(rows)} measured trials, at PPL {s['ppl']:.2f} "
            f"(x{(s['ppl_ratio'] or float('nan')):.3f} of fp32)")
    if others:
        o = others[0]
        line += (f"; runner-up trial {o.number} ({', '.join(f'{k}={v}' for k, v in o.params.items())}): "
                 f"{o.summary['throughput']:.1f} tok/s, {o.summary['memory_mb']:.1f} MiB")
    if best.heldout:
        h = best.heldout
        line += (f"; on held-out prompts {_fmt_primary(primary_value(h['summary'], sc), sc)}"
                 f"{'' if h['feasible'] else ' (misses a constraint there)'}")
        for c in best.shipped or []:
            said = verdict(h["summary"], c["summary"], sc)
            # a shipped recipe that misses a constraint of the scenario loses to a feasible winner whatever its value
            if not h["feasible"]:
                said = "does NOT beat"
            elif not c["feasible"]:
                said = "beats"
            same = " (the same configuration)" if c.get("same_config") else ""
            line += (f"; {said} shipped recipe {c['name']}{same} ({_fmt_primary(primary_value(c['summary'], sc), sc)}"
                     f"{'' if c['feasible'] else ', infeasible'} on the same held-out prompts)")
    return line


def _relative(value: str, start: Path) -> str:
    """``value`` relative to ``start`` when it is an existing local path (found recipes hold no machine paths)."""
    p = Path(value)
    if p.is_absolute() and p.exists():
        return os.path.relpath(p, start.resolve())
    return value


def _portable_recipe(data: dict, recipe_dir: Path) -> dict:
    """Model sources that are local paths, rewritten relative to the recipe file's directory."""
    data = json.loads(json.dumps(data))
    for section in ("target", "draft"):
        if isinstance(data.get(section), dict) and isinstance(data[section].get("source"), str):
            data[section]["source"] = _relative(data[section]["source"], recipe_dir)
    return data


def _portable_storage(url: str, recipe_dir: Path) -> str:
    if url.startswith("sqlite:///"):
        return "sqlite:///" + _relative(url[len("sqlite:///"):], recipe_dir)
    return url


def _summary_line(s: dict) -> str:
    return (f"throughput {s['throughput']:.2f} tok/s [{s['throughput_min']:.2f}-{s['throughput_max']:.2f}], "
            f"ratios {json.dumps({k: round(v, 3) for k, v in s['ratios'].items()})}, perplexity {s['ppl']:.3f} "
            f"(x{(s['ppl_ratio'] or float('nan')):.4f} of fp32), memory {s['memory_mb']:.2f} MiB "
            f"(weights {s['weights_mb']:.2f} + peak KV {s['kv_peak_mb']:.2f}), alpha {s['alpha']:.3f}, "
            f"tau {s['tau']:.3f}, TTFT {s['ttft_ms']:.1f} ms"
            + ("" if s.get("rouge_l") is None else f", ROUGE-L vs fp32 AR {s['rouge_l']:.3f}"))


def write_found_recipe(path: Path, best: TrialRow, rows: list[TrialRow], sp: SearchSpace, sc: Scenario, settings,
                       study_name: str, storage: str, counts: dict | None = None, base: Path | None = None) -> None:
    """Write the winner as a runnable recipe with provenance comments and a "why it won" description.

    No machine paths: local model sources, the SQLite study and results directories are written relative to the
    recipe file's directory; the space is named by its place under ``recipes/``."""
    import optuna

    from toolkit.measure.harness import environment
    from toolkit.recipe import Recipe

    path = Path(path)
    here = path.parent
    recipe = Recipe.from_dict({**_portable_recipe(best.recipe, here), "name": f"found-{sc.name}"})
    why = _why(best, rows, sc)
    recipe = recipe.replace(description=f"Found by `toolkit search --scenario {sc.name}`: {why}.")
    env = environment()
    s = best.summary
    bounds = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("name", "primary") and v is not None}
    results = best.results_dir
    if base is not None and results and not Path(results).is_absolute():
        results = _relative(str((Path(base) / results).resolve()), here)
    header = [
        f"# Found by `toolkit search --scenario {sc.name}` (study {study_name}, trial {best.number}, "
        f"{len(rows)} measured trials; storage {_portable_storage(storage, here)})",
        f"# Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# Hardware: {env['hardware']} ({env['platform']}, {env['torch_threads']} torch threads)",
        f"# Versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"optuna {optuna.__version__}" + (f", bitsandbytes {env['bitsandbytes']}" if "bitsandbytes" in env else ""),
        f"# Space: {_relative(sp.source, here)}; params: {best.params}; scenario bounds: {bounds}",
    ]
    if counts:
        header.append(f"# {_counts_line(counts)}")
    header += [
        f"# Search measurement (eval settings {json.dumps(settings.to_dict())}):",
        f"#   {_summary_line(s)}",
        f"#   constraints {json.dumps({k: round(v, 4) for k, v in best.constraints.items()})} (<= 0 = met)",
    ]
    if best.heldout:
        h = best.heldout
        header += [
            f"# Held-out confirmation (prompt suite {h['prompts']!r}, never seen by the search; every baseline timed "
            "again in the same run):",
            f"#   {_summary_line(h['summary'])}",
            f"#   constraints {json.dumps({k: round(x, 4) for k, x in h['constraints'].items()})} -> "
            f"{'feasible' if h['feasible'] else 'NOT FEASIBLE on held-out prompts'}",
        ]
        for c in best.shipped or []:
            header.append(f"#   shipped recipe {c['name']} on the same prompts: {_summary_line(c['summary'])}"
                          f"{'' if c['feasible'] else ' (infeasible)'}")
    header += [
        f"# Why it won: {why}",
        f"# Results: {results} (paths in this file are relative to it)",
        "",
    ]
    atomic_write_text(path, "\n".join(header) + recipe.to_yaml())
