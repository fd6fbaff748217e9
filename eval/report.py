"""Markdown report and PNG plots of one evaluation (matplotlib, Agg backend).

Plots: ``throughput_vs_length.png`` (cumulative tokens/s of our loop along the generation, baselines as points at
their final length), ``kv_bytes_vs_length.png`` (exact target/draft KV bytes after every round vs the uncompressed
cache), ``acceptance_by_position.png`` (accepted_at[i] / drafted_at[i]).
"""

from __future__ import annotations

from pathlib import Path

from toolkit.io import atomic_write_png, atomic_write_text
from toolkit.speculative.drafters import config_type
from toolkit.speculative.drafters.registry import DRAFT_UNUSED

MB = 1024 * 1024


def _fmt_summary(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / MB:.2f} MiB"


def _budget_lines(budget: dict | None, settings: dict) -> list[str]:
    """What a time budget cut (``metrics.json`` ``budget``), before the results it qualifies."""
    if budget is None:
        return []
    cuts = ", ".join(f"{k} {a} → {b}" for k, (a, b) in budget["cuts"].items()) or "nothing"
    planned = budget["cuts"].get("repeats", [None, settings["repeats"]])[1]
    return [f"**Time budget {budget['time_budget_s']:.0f} s**: the protocol asked for needs about "
            f"{budget['requested_estimate_s']:.0f} s on this machine (estimated from the target's cost curve); cut: "
            f"{cuts} (estimate {budget['estimate_s']:.0f} s{'' if budget['fits'] else ', still over the budget'}); "
            f"{budget['repeats_done']} of {planned} timed repetitions ran.", ""]


def _batch_lines(batch: dict | None) -> list[str]:
    """The batch stage's table (recipes that set ``batch_size``)."""
    if batch is None:
        return []
    how = "batched" if batch["batched"] else "one request at a time (this recipe cannot batch)"
    lines = ["", f"### Batch size {batch['batch_size']} ({how})", "",
             f"{len(batch['prompts'])} prompts, every method over all of them, {batch['repeats']} timed "
             "repetition(s); throughput = all new tokens / wall time, median [min–max].", "",
             "| method | new tokens | throughput (tok/s) | peak RSS |", "|---|---|---|---|"]
    for name, e in batch["methods"].items():
        lines.append(f"| {name}{' (reused)' if e.get('reused') else ''} | {e['new_tokens']} | "
                     f"{_fmt_summary(e['throughput'])} | {_mb(e['peak_rss_bytes'])} |")
    if batch["ratios"]:
        lines += ["", "Ratios: " + ", ".join(f"{k.replace('_vs_', ' / ')} = **{v:.2f}×**"
                                            for k, v in batch["ratios"].items())]
    same = batch["rows_identical_to_single"]
    if same is not None:
        lines += ["", f"Rows identical to the prompt decoded alone: {sum(same)}/{len(same)}."]
    return lines


def _quality_lines(q: dict | None) -> list[str]:
    """The output-quality section: ROUGE-L (summarization prompts) and exact match / first divergence (code prompts)
    of the recipe's text against the fp32 AR reference text (``metrics.json`` ``quality``)."""
    if q is None:
        return []
    lines = ["## Output quality vs the fp32 AR reference", ""]
    if q["reference"] is None:
        return lines + [f"Not measured: {q.get('reason', 'no reference')}.", ""] + _written_lines(q)
    lines += [f"Reference: {q['reference']['description']}; same prompts, same max_new_tokens. Computed with the "
              "shipped evaluate modules (toolkit/metrics)" + ("" if q["greedy"] else "; sampling recipe: one sample "
                                                                 "per prompt, exact agreement is not expected") + ".",
              "", "| prompt | metric | value |", "|---|---|---|"]
    r, c = q["rouge_l"], q["code"]
    for p in (r["prompts"] if r else []):
        lines.append(f"| {p['id']} | ROUGE-L F1 (precision / recall) | {p['value']:.3f} ({p['precision']:.3f} / "
                     f"{p['recall']:.3f}) |")
    for p in (c["prompts"] if c else []):
        where = "identical" if p["first_divergence"] is None else f"first divergence at token {p['first_divergence']}"
        lines.append(f"| {p['id']} | exact match; first divergence (fraction matched) | "
                     f"{'yes' if p['exact_match'] else 'no'}; {where} ({p['matched_fraction']:.3f} of "
                     f"{p['reference_tokens']} tokens) |")
    summary = []
    if r:
        summary.append(f"mean ROUGE-L F1 over summarization prompts **{r['value']:.3f}** ({r['tokenization']})")
    if c:
        summary.append(f"code exact match **{c['exact_match']:.2f}**, mean matched fraction "
                       f"{c['matched_fraction']:.3f}")
    lines += ["", "; ".join(summary) + "." + (f" ({q['reason']}.)" if q.get("reason") else ""), ""]
    return lines + _written_lines(q)


def _written_lines(q: dict) -> list[str]:
    """ROUGE-L against the prompt suite's written answers (``quality.rouge_l_written``), where the suite gives some."""
    w = q.get("rouge_l_written")
    if not w:
        return []
    head = ["### Against the suite's written answers", "", "| prompt | ROUGE-L F1 (precision / recall) |", "|---|---|"]
    rows = [f"| {p['id']} | {p['value']:.3f} ({p['precision']:.3f} / {p['recall']:.3f}) |" for p in w["prompts"]]
    return head + rows + ["", f"Mean ROUGE-L F1 against the written answers **{w['value']:.3f}** "
                              f"({w['tokenization']}).", ""]


def _perplexity_lines(p: dict) -> list[str]:
    """The perplexity section: through the cache as configured, sliding window, the fp32 reference."""
    lines = ["## Perplexity", "", f"Text: {p['text']}", "",
             "| measure | PPL | protocol |", "|---|---|---|"]
    c = p["configured"]
    lines.append(f"| recipe's target as configured (precision + KV policy) | {c['value']:.3f} | teacher-forced "
                 f"through the cache in chunks of K+1 = {c['protocol']['chunk_tokens']} tokens, commit after each "
                 f"chunk; {c['tokens']} predicted tokens, token-level mean NLL (natural log) |")
    s = p["sliding_window"]
    lines.append(f"| recipe's target, uncompressed, sliding window | {s['value']:.3f} | window "
                 f"{s['protocol']['window']}, stride {s['protocol']['stride']}, {s['tokens']} predicted tokens, "
                 f"token-level |")
    if p["reference_fp32"]:
        ref = p["reference_fp32"]
        lines.append(f"| fp32 uncompressed reference | {ref['value']:.3f} | full context over the same "
                     f"{ref['tokens']} predicted tokens, token-level |")
        lines += ["", f"PPL ratio (configured / fp32 reference): **{p['ratio_to_fp32']:.4f}**"]
    return lines


def _memory_lines(mem: dict) -> list[str]:
    """The memory section: weights, KV allocated / held / uncompressed bytes, compressions."""
    kv = mem["kv_bytes"]
    lines = ["## Memory", "", "| quantity | bytes |", "|---|---|",
             f"| weights target / draft | {_mb(mem['weight_bytes']['target'])} / {_mb(mem['weight_bytes']['draft'])} |",
             f"| KV target peak / final (exact bytes allocated) | {_mb(kv['target_peak'])} / "
             f"{_mb(kv['target_final'])} |",
             *([f"| KV target peak held (a cache sized to the rows would need) | {_mb(kv['target_peak_needed'])} |"]
               if "target_peak_needed" in kv else []),
             f"| KV draft peak / final (exact) | {_mb(kv['draft_peak'])} / {_mb(kv['draft_final'])} |",
             f"| KV target uncompressed at the same length (computed: {kv['per_token_uncompressed']:,} bytes a token, "
             f"HF's DynamicCache in the activations' dtype; the static engine stores half precision as float32 on "
             f"a CPU) | {_mb(kv['uncompressed_target_peak'])} |",
             *([f"| KV batch cache peak (exact bytes of its allocated buffers) | {_mb(kv['batch_peak'])} |"]
               if "batch_peak" in kv else []),
             f"| weights + peak KV | {_mb(mem['total_peak_bytes'])} |",
             f"| compressions target / draft | {mem['compressions']['target']} / {mem['compressions']['draft']} |"]
    return lines


def _fidelity_lines(fidelity: dict) -> list[str]:
    """The fidelity section: greedy token agreement with HF's uncompressed and fp32 greedy text."""
    lines = ["", "## Fidelity (greedy token agreement)", ""]
    for key, label in (("vs_ar", "vs the recipe's target, uncompressed, HF greedy"),
                       ("vs_fp32", "vs the fp32 uncompressed target, HF greedy")):
        f = fidelity.get(key)
        if f:
            lines.append(f"- {label}: match rate {f['match_rate']:.3f}, matching prefix {f['prefix_match']:.3f}, "
                         f"first divergence per prompt {f['first_divergence']} "
                         f"({'identical' if f['identical'] else 'differs'}; {f['compared_tokens']} tokens)")
    if not fidelity.get("greedy", True):
        lines.append("- (sampling recipe: agreement with a greedy reference is not expected)")
    return lines


def markdown(m: dict) -> str:
    """The report.md text of a metrics dict."""
    r, p, a, mem, env = m["recipe"], m["perplexity"], m["acceptance"], m["memory"], m["environment"]
    proto = m["protocol"]
    lines = [f"# Evaluation: {r['name']} ({r['config_hash']})", ""]
    cfg = r["config"]
    uses_draft = config_type(cfg["spec"]["drafter"]).draft != DRAFT_UNUSED
    weights = r.get("weights") or {}  # which weights the target ran, in words (older documents: the precision)
    lines += [f"target {cfg['target']['source']} @ {weights.get('target') or cfg['target']['precision']}, drafter "
              f"{cfg['spec']['drafter']}"
              + (f" ({cfg['draft']['precision']})" if cfg.get("draft") and uses_draft else "")
              + f", K={cfg['spec']['num_draft_tokens']} ({cfg['spec']['adaptive']}), KV {cfg['kv']}", "",
              f"Hardware: {env['hardware']} · torch {env['torch']} · transformers {env['transformers']} · "
              f"{env['date']} · settings: {m['settings']['mode']}", ""]
    lines += _budget_lines(m.get("budget"), m["settings"])
    lines += _perplexity_lines(p)
    lines += [""] + _quality_lines(m.get("quality"))
    lines += ["## Speed", "",
              f"{proto['num_prompts']} prompts, {proto['max_new_tokens']} new tokens each (EOS "
              f"{'disabled' if proto['ignore_eos'] else 'enabled'}), {proto['warmup']} warm-up call(s) per method, "
              f"{proto['repeats']} repetitions, median [min–max]. {proto.get('timing', '')}", "",
              "| method | throughput (tok/s) | TTFT (ms) | TPOT (ms) | peak memory |", "|---|---|---|---|---|"]
    for name, e in m["methods"].items():
        peak = e["peak_memory"]
        pm = (f"RSS {_mb(peak.get('peak_rss_bytes'))} (+{_mb(peak.get('peak_rss_growth_bytes'))})"
              if peak.get("device") == "cpu" else
              f"alloc {_mb(peak.get('peak_allocated_bytes'))}, reserved {_mb(peak.get('peak_reserved_bytes'))}")
        lines.append(f"| {name} | {_fmt_summary(e['throughput'])} | {_fmt_summary(e['ttft_ms'], 1)} | "
                     f"{_fmt_summary(e['tpot_ms'], 1)} | {pm} |")
    if m["ratios"]:
        lines += ["", "Throughput ratios (medians, same process): "
                  + ", ".join(f"{k.replace('_vs_', ' / ')} = **{v:.2f}×**" for k, v in m["ratios"].items())]
    lines += _batch_lines(m.get("batch"))
    lines += ["", "## Acceptance", "",
              f"α = {a['acceptance_rate']:.3f} (accepted {a['accepted']} / drafted {a['drafted']}), "
              f"τ = {a['tokens_per_round']:.3f} tokens per round ({a['committed']} committed / {a['rounds']} "
              f"rounds), target forwards {a['target_forwards']}, draft forwards {a['draft_forwards']}; counters "
              f"{'consistent' if a['consistent'] else 'INCONSISTENT: ' + '; '.join(a['problems'])}.", "",
              "Per-position acceptance: " + ", ".join(f"{i}: {v:.2f}" for i, v in enumerate(a["curve"])), ""]
    lines += _memory_lines(mem)
    lines += _fidelity_lines(m["fidelity"])
    if m.get("files"):
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in m["files"].items() if v.endswith(".png")]
    lines += ["", f"Elapsed: {m['elapsed_s']:.1f} s", ""]
    return "\n".join(lines)


def plots(m: dict, out: Path) -> dict:
    """Write the three PNGs into ``out``; returns ``{name: filename}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    # throughput vs generated length
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in m["trajectories"]:
        rows = [r for r in t["rows"] if r[1] > 0]
        ax.plot([r[0] for r in rows], [r[0] / (r[1] / 1000) for r in rows], label=f"ours: {t['prompt']}")
    for name, e in m["methods"].items():
        if name != "ours":
            ax.scatter([e["new_tokens"] / max(1, m["protocol"]["num_prompts"])], [e["throughput"]["median"]],
                       marker="o", label=f"{name} (median)")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("throughput (tokens/s, cumulative)")
    ax.set_title("Throughput vs generated length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_png(out / "throughput_vs_length.png", fig)
    plt.close(fig)
    files["throughput_vs_length"] = "throughput_vs_length.png"
    # KV bytes vs generated length
    fig, ax = plt.subplots(figsize=(6, 4))
    per_token = m["memory"]["kv_bytes"]["per_token_uncompressed"]
    for t, prompt in zip(m["trajectories"], m["prompts"]):
        rows = t["rows"]
        xs = [r[0] for r in rows]
        ax.plot(xs, [r[2] / 2**20 for r in rows], label=f"target: {t['prompt']}")
        if any(r[3] for r in rows):
            ax.plot(xs, [r[3] / 2**20 for r in rows], linestyle="--", label=f"draft: {t['prompt']}")
        ax.plot(xs, [per_token * (prompt["prompt_tokens"] + x - 1) / 2**20 for x in xs], linestyle=":",
                color="gray", label="uncompressed target" if t is m["trajectories"][0] else None)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV cache (MiB, exact nbytes)")
    ax.set_title("KV bytes vs generated length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_png(out / "kv_bytes_vs_length.png", fig)
    plt.close(fig)
    files["kv_bytes_vs_length"] = "kv_bytes_vs_length.png"
    # acceptance by draft position
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = m["acceptance"]["curve"]
    ax.bar(range(1, len(curve) + 1), curve)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Acceptance by draft position (α = {m['acceptance']['acceptance_rate']:.2f})")
    fig.tight_layout()
    atomic_write_png(out / "acceptance_by_position.png", fig)
    plt.close(fig)
    files["acceptance_by_position"] = "acceptance_by_position.png"
    return files


def write_report(m: dict, out: Path, plots: bool = True) -> dict:
    """Write plots (optional) and report.md into ``out``; returns the file map stored in metrics.json."""
    files = {"config": "config.yaml", "metrics": "metrics.json", "report": "report.md"}
    if plots:
        files.update(globals()["plots"](m, out))
    m = dict(m, files=files)
    atomic_write_text(out / "report.md", markdown(m))
    return files
