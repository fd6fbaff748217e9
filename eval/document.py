"""The ``metrics.json`` document of one evaluation (schema: ``eval/metrics.schema.json``): per-method speed and
peak memory, ratios to the baselines, fidelity, memory (weights, KV allocated / needed / uncompressed), quality and
the acceptance trajectories, from what :func:`eval.evaluate.evaluate` measured; and its schema check."""

from __future__ import annotations

import json
import time
from pathlib import Path

from eval import metrics as M
from eval.quality import quality_section
from eval.runners import OURS
from toolkit.measure.harness import environment

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("metrics.schema.json")


def _downsample(rows: list, limit: int = 200) -> list:
    if len(rows) <= limit:
        return rows
    step = len(rows) / limit
    picked = [rows[int(i * step)] for i in range(limit)]
    if picked[-1] is not rows[-1]:
        picked.append(rows[-1])
    return picked


def _method_metrics(measured, reused: dict, first: dict) -> dict:
    out = {}
    for m in measured.methods:
        entry = measured.speed(m)
        entry["peak_memory"] = M.merge_peaks([c.peak for rep in measured.calls[m] for c in rep])
        if m != OURS:
            entry["target_forwards"] = sum(s.target_forwards for _, s in first[m])
            entry["tokens_per_round"] = (sum(s.committed for _, s in first[m]) /
                                         max(1, sum(s.rounds for _, s in first[m])))
        if m in reused:
            entry["reused"] = True
        out[m] = entry
    return out


def _ratios(method_metrics: dict) -> dict:
    def ratio(a, b):
        if a in method_metrics and b in method_metrics:
            den = method_metrics[b]["throughput"]["median"]
            return method_metrics[a]["throughput"]["median"] / den if den > 0 else None
        return None

    pairs = {"ours_vs_ar": ("ours", "ar"), "ours_vs_ar_static": ("ours", "ar_static"),
             "ours_vs_assisted": ("ours", "assisted"),
             "ours_vs_prompt_lookup": ("ours", "prompt_lookup"), "ours_vs_prompt_lookup_10": ("ours", "prompt_lookup_10"),
             "assisted_vs_ar": ("assisted", "ar"), "ours_vs_ar_fp32": ("ours", "ar_fp32")}
    ratios = {name: ratio(a, b) for name, (a, b) in pairs.items()}
    return {k: v for k, v in ratios.items() if v is not None}


def _fidelity(run, first: dict) -> dict:
    fid = {}
    if "ar" in first:
        fid["vs_ar"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], first["ar"])])
    ref_runs = first.get("ar_fp32") or (first.get("ar") if run.reference_model is run.target else None)
    if ref_runs is not None:
        fid["vs_fp32"] = M.fidelity_summary([(a, b) for (a, _), (b, _) in zip(first["ours"], ref_runs)])
    fid["greedy"] = not run.gen.do_sample
    return fid


def _memory(run, ours_stats: list, ppl_conf: dict, peak: dict, batch: dict | None) -> dict:
    weights = run.generator.weight_bytes
    per_token = M.kv_bytes_per_token(run.target)
    lengths = [s.prompt_tokens + s.new_tokens - 1 for s in ours_stats]
    memory = {
        "weight_bytes": {"target": weights["target"], "draft": weights["draft"],
                         "total": weights["target"] + weights["draft"]},
        "kv_bytes": {
            "target_final": max(s.kv_bytes_target for s in ours_stats),
            "draft_final": max(s.kv_bytes_draft for s in ours_stats),
            "target_peak": max(s.peak_kv_bytes_target for s in ours_stats),
            "target_peak_needed": max(s.peak_kv_bytes_needed_target for s in ours_stats),
            "draft_peak": max(s.peak_kv_bytes_draft for s in ours_stats),
            "uncompressed_target_peak": per_token * max(lengths),
            "per_token_uncompressed": per_token,
            "ppl_run_target_peak": ppl_conf["peak_kv_bytes"],
        },
        "compressions": {"target": sum(s.compressions_target for s in ours_stats),
                         "draft": sum(s.compressions_draft for s in ours_stats)},
        "peak": peak,
    }
    kv_peak = memory["kv_bytes"]["target_peak"] + memory["kv_bytes"]["draft_peak"]
    if batch is not None:  # the batch cache holds every row at once
        memory["kv_bytes"]["batch_peak"] = batch["kv_peak_bytes"]
        kv_peak = max(kv_peak, batch["kv_peak_bytes"])
    memory["total_peak_bytes"] = memory["weight_bytes"]["total"] + kv_peak
    return memory


def document(run, measured, reused: dict, perplexity: dict, started: float, batch: dict | None) -> dict:
    """The ``metrics.json`` document of one evaluation (``run``: :class:`eval.evaluate._Run`)."""
    recipe, settings, gen, items = run.recipe, run.settings, run.gen, run.items
    first = {m: [(c.token_ids, c.stats) for c in measured.first(m)] for m in measured.methods}
    ours_stats = [s for _, s in first[OURS]]
    method_metrics = _method_metrics(measured, reused, first)
    trajectories = [c.trajectory for c in measured.first(OURS)]
    return {
        "schema_version": SCHEMA_VERSION,
        "recipe": {"name": recipe.name, "config_hash": recipe.config_hash(), "config": recipe.to_dict(),
                   "weights": dict(run.generator.weights)},
        "settings": run.requested.to_dict(),
        **({"budget": run.budget.to_dict() | {"repeats_done": len(measured.calls[OURS])}} if run.budget else {}),
        "environment": environment(),
        "protocol": {
            "max_new_tokens": gen.max_new_tokens, "ignore_eos": gen.ignore_eos, "do_sample": gen.do_sample,
            "warmup": settings.warmup, "repeats": len(measured.calls[OURS]), "num_prompts": len(items),
            "timing": "wall clock with device synchronization; per repetition: throughput = new tokens / time over "
                      "all prompts, TTFT/TPOT = mean over prompts; median [min-max] over repetitions",
        },
        "prompts": [{"id": it.id, "kind": it.kind, "prompt_tokens": int(it.input_ids.shape[1])} for it in items],
        "perplexity": perplexity,
        "acceptance": M.acceptance(ours_stats),
        "memory": _memory(run, ours_stats, perplexity["configured"], method_metrics["ours"]["peak_memory"], batch),
        "methods": method_metrics,
        "ratios": _ratios(method_metrics),
        "fidelity": _fidelity(run, first),
        "quality": quality_section(items, first, run.generator, run.reference_model, gen),
        "trajectories": [{"prompt": it.id, "rows": _downsample(t)} for it, t in zip(items, trajectories)],
        **({"batch": batch} if batch is not None else {}),
        "elapsed_s": time.perf_counter() - started,
        "skipped": False,
    }


def validate_metrics(data: dict) -> None:
    """Raise ``ValueError`` unless ``data`` matches ``eval/metrics.schema.json``."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    try:
        jsonschema.validate(json.loads(json.dumps(data, default=str)), schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"metrics do not match {SCHEMA_PATH.name} at '{where}': {exc.message}") from exc
