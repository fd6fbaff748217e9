"""The kit's Markdown report (every table) and the short summary printed last."""

from __future__ import annotations


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def markdown(results: dict) -> str:
    """Every stage's table; a failed or skipped stage says so with its error."""
    lines = ["# GPU benchmark kit", ""]
    env = results.get("environment", {}).get("result")
    if env:
        lines += [f"Device: {env.get('gpu') or env['device']} · torch {env['torch']} · transformers "
                  f"{env['transformers']} · dtype {env['dtype']} · dry run: {env['dry_run']} · "
                  f"compile: {env['compile']} · tokenizer: {env['tokenizer']}", "",
                  "Packages: " + "; ".join(f"{k} {v}" for k, v in env["packages"].items()), ""]
    lines += ["## Stages", ""] + _table(["stage", "status", "seconds", "error"], [
        [name, r["status"], r["seconds"], r.get("error", "")] for name, r in results.items()]) + [""]
    for name, render in (("greedy", _greedy), ("sampling", _sampling), ("kv", _kv), ("verify_cost", _verify),
                         ("verify_cost_more", _verify),
                         ("speed", _speed), ("speed_real", _speed_real), ("projection", _projection)):
        result = results.get(name, {}).get("result")
        if result is not None:
            lines += render(result) + [""]
    from gpu_kit.targets import markdown as second_edition

    lines += second_edition(results, _table)
    return "\n".join(lines) + "\n"


def _greedy(result: dict) -> list[str]:
    return ["## Greedy identity to HF `generate` (fp32)", ""] + _table(
        ["path", "identical", "first divergence", "τ", "note"],
        [[r["path"], r["ok"], r["first_divergence"], r["tau"], r.get("skipped", "")] for r in result["rows"]])


def _sampling(result: dict) -> list[str]:
    return ["## Sampling", "", f"{result['test']}: {result['draws']} draws ({result['drafted']} draft tokens), "
            f"p = {result['p_value']:.3f} "
            f"({'passes' if result['ok'] else '**fails**'} p > 0.01)"]


def _kv(result: dict) -> list[str]:
    return ["## KV policies: device vs CPU (greedy tokens, lookup drafter)", ""] + _table(
        ["policy", "equal", "first divergence", "compressions", "KV bytes"],
        [[r["policy"], r["ok"], r["first_divergence"], r["compressions"], r["kv_bytes"]] for r in result["rows"]])


def _verify(result: dict) -> list[str]:
    lines = ["## Verify cost: ms of one forward over n new tokens per row (relative to n = 1)", ""]
    for shape, data in result.items():
        for batch, curve in data["batches"].items():
            widths = list(curve["ms"])
            lines += [f"**{shape}** ({data['params'] / 1e6:.0f}M parameters), B = {batch}, {data['context']} "
                      "tokens of context:", ""] + _table(
                ["n"] + [str(n) for n in widths],
                [["ms"] + [curve["ms"][n] for n in widths], ["× n=1"] + [curve["relative"][n] for n in widths]]) + [""]
    return lines


def _speed(result: dict) -> list[str]:
    lines = ["## Speed: tok/s (prefill included), same weights and prompts, EOS off", ""]
    for shape, data in result.items():
        base = data["rows"].get("HF AR", {}).get("tok_s")
        rows = []
        for method, r in data["rows"].items():
            peak = r.get("peak", {}).get("peak_allocated_bytes", r.get("peak", {}).get("peak_rss_bytes"))
            rows.append([method, r.get("tok_s"), r["tok_s"] / base if base and r.get("tok_s") else None,
                         r.get("alpha"), r.get("tau"), r.get("round_overhead_pct"),
                         peak / 2**20 if peak else None, r.get("first_call_s"), r.get("error", "")])
        lines += [f"**{shape}**", ""] + _table(
            ["method", "tok/s", "× HF AR", "α", "τ", "host overhead % of a round", "peak MiB",
             "first call s (compile)", "error"], rows)
        lines += [f"Skipped: {k}: {v}" for k, v in data.get("skipped", {}).items()] + [""]
    lines.append("Random weights: α and τ of the drafters here say nothing about real text (see the projection).")
    return lines


def _speed_real(result: dict) -> list[str]:
    rows = result["rows"]
    base = rows.get("HF static cache + compiled AR", {}).get("tok_s")
    same = result.get("lookup_equals_ar")
    lines = [f"## Real weights: {result['model']} ({result['dtype']}) on the `{result['suite']}` suite", "",
             f"{result['requests']} requests in order, {result['max_new_tokens']} new tokens each, EOS off; ours on "
             f"the {result['path']} engine; lookup with memory across requests, cost-aware K.", ""] + _table(
        ["method", "tok/s (pass)", "× HF static compiled", "median tok/s per request", "α", "τ", "error"],
        [[m, r.get("tok_s"), r["tok_s"] / base if base and r.get("tok_s") else None,
          r.get("tok_s_per_request_median"), r.get("alpha"), r.get("tau"), r.get("error", "")]
         for m, r in rows.items()])
    if same is not None:
        lines += ["", f"Our lookup's tokens equal our AR's on {sum(c['ok'] for c in same)} of {len(same)} requests "
                  f"(first divergences: {[c['first_divergence'] for c in same if not c['ok']]})."]
    return lines


def _projection(result: dict) -> list[str]:
    lines = ["## Projected speedups over our AR (CPU-measured acceptance × this device's verify curve)", ""]
    for shape, rows in result.items():
        lines += [f"**{shape}**", ""] + _table(
            ["source (real weights, CPU)", "α", "τ", "mean verify width", "projected × our AR", "note"],
            [[r["source"], r["alpha"], r["tau"], r["mean_verify_width"], r["projected_speedup_vs_our_ar"],
              r.get("note", "")] for r in rows]) + [""]
    return lines


def summary(results: dict) -> str:
    """A few lines: each stage's status, identity / sampling / KV verdicts, and tok/s of ours vs HF per shape."""
    lines = ["", "GPU kit summary", "---------------"]
    for name, r in results.items():
        lines.append(f"{name:<16} {r['status']:<8} {r['seconds'] or 0:6.1f} s  {r.get('error', '')[:80]}")
    greedy = results.get("greedy", {}).get("result")
    if greedy:
        bad = [r["path"] for r in greedy["rows"] if r["ok"] is False]
        lines.append(f"greedy identity: {'all identical' if not bad else 'DIFFERS: ' + ', '.join(bad)}")
    sampling = results.get("sampling", {}).get("result")
    if sampling:
        lines.append(f"sampling chi-square: p = {sampling['p_value']:.3f}")
    kv = results.get("kv", {}).get("result")
    if kv:
        lines.append(f"KV policies device == CPU: {kv['all_equal']}")
    for shape, data in (results.get("speed", {}).get("result") or {}).items():
        cells = [f"{m} {r['tok_s']:.1f}" for m, r in data["rows"].items() if r.get("tok_s")]
        lines.append(f"{shape} tok/s: " + ", ".join(cells))
    from gpu_kit.targets import summary_lines

    return "\n".join(lines + summary_lines(results))
