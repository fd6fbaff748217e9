"""The kit's speed stages: the verify cost curve, end-to-end tok/s of HF's decoders and ours with each drafter
(with peak device memory and host overhead per round), and projected speedups from CPU-measured acceptance.

Times: CUDA events on a GPU, ``time.perf_counter`` on the CPU (:func:`toolkit.measure.timing.time_ms`); every
method runs on the same model objects, prompts and ``max_new_tokens``, EOS disabled, methods interleaved per prompt.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from eval.metrics import PeakMemory
from gpu_kit import shapes
from gpu_kit.checks import compiled_forward, eagle_head, ours, ours_batch
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK, CostAwareK
from toolkit.kv.static import capacity_for
from toolkit.measure.baselines import hf_generate
from toolkit.measure.timing import synchronize, time_ms
from toolkit.recipe import GenerationSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter
from toolkit.speculative.drafters.eagle import EagleDrafter
from toolkit.speculative.verify_length import Calibrator


def curve_ms(kit, forward, batch: int, context: int, widths: list[int], what: str = "") -> dict:
    """``{n: ms}``: the median ms of one forward over ``n`` new tokens per row of ``batch`` rows after ``context``
    random cached tokens, for each ``n`` of ``widths``, on ``forward``'s static cache (nothing is accepted, so every
    forward sees the same context); widths past the time budget are left out (the first always runs)."""
    widest = forward.width_for(max(widths))
    cache = forward.cache_for(None, batch, capacity_for(context + widest), widest)
    vocab = forward.model.config.vocab_size
    prompt = torch.randint(1, vocab, (1, context), device=kit.device)
    row = {}
    with torch.no_grad(), forward.attached():
        for _ in range(batch):
            prefilled, kwargs = cache.begin_row(context)
            forward.prefill(prompt, kwargs)
            cache.add_row(prefilled, context)
        for n in widths:
            if row and kit.out_of_time(f"verify cost of {what}, n = {n}"):
                break
            tokens = torch.randint(1, vocab, (batch, n), device=kit.device)
            summary, _ = time_ms(lambda tokens=tokens: forward(cache, tokens), kit.device, repeats=kit.timing_repeats)
            row[n] = summary.median
    return row


def verify_cost_more(kit) -> dict:
    """The verify curves of ``kit.more_verify`` (more shapes and batch sizes), measured last in the time left."""
    return verify_cost(kit, kit.more_verify, stage="verify_cost_more")


def verify_cost(kit, plan: dict | None = None, stage: str = "verify_cost") -> dict:
    """ms of one target forward over ``n`` new tokens per row after ``kit.context`` cached tokens, for each shape and
    batch size of ``plan`` (``{shape: [B, ...]}``; default: every speed shape at ``kit.batch_sizes``) and every
    ``n``, through the decoder's own forward on its static cache (compiled: CUDA graphs on a GPU; eager where the kit
    does not compile); nothing is accepted, so every forward sees the same context. What is measured so far is saved
    under ``stage`` after each batch size (a run stopped from outside keeps it)."""
    out = {}
    plan = plan if plan is not None else {name: kit.batch_sizes for name in kit.speed_shapes}
    for name, batches in plan.items():
        if kit.out_of_time(f"verify cost of {name}"):
            break
        model = kit.model(name, kit.dtype)
        forward = compiled_forward(kit, model) if kit.compile_backend != "none" else TargetForward(model)
        per_batch = {}
        for batch in batches:
            if kit.out_of_time(f"verify cost of {name} at B = {batch}"):
                break
            row = curve_ms(kit, forward, batch, kit.context, kit.widths, f"{name} at B = {batch}")
            if not row:
                continue
            per_batch[batch] = {"ms": row, "relative": {n: ms / row[kit.widths[0]] for n, ms in row.items()}}
            out[name] = {"params": shapes.SHAPES[name].params(), "context": kit.context, "batches": per_batch,
                         "path": "CUDA graphs" if forward.compiled and kit.device.type == "cuda" else
                         "compiled" if forward.compiled else "eager"}
            kit.partial(stage, out)
        model = forward = None
    return out


def hf_static_compiled(model, ids: torch.Tensor, gen: GenerationSpec, backend: str, mode: str | None):
    """HF static-cache compiled AR (the ``ar_static`` baseline of :func:`toolkit.measure.baselines.hf_generate`)
    with ``backend`` and ``mode`` (``reduce-overhead`` = CUDA graphs), EOS ignored. Prompts of one length and one
    ``max_new_tokens`` keep one cache shape, so the first call's compile serves every later call. Returns the new
    ids; the caller times the call."""
    new_ids, _ = hf_generate(model, ids, gen, [], method="ar_static", compile_backend=backend, compile_mode=mode)
    return new_ids


def measured_curve(curve_ms: dict, max_tokens: int | None = None) -> VerifyCost:
    """The decoder's cost curve (:meth:`VerifyCost.from_points`) from the verify stage's ``{n: ms}``, over
    ``1 .. max_tokens`` (default: the widest measured; past it :meth:`VerifyCost.ms` extends the last slope)."""
    widths = sorted(int(n) for n in curve_ms)
    ms = [curve_ms[n] if n in curve_ms else curve_ms[str(n)] for n in widths]
    return VerifyCost.from_points(widths, ms, min(max_tokens or widths[-1], widths[-1]), learn=False)


def _our_methods(kit, target, draft, curve: VerifyCost):
    cost = CostAwareK(curve, Calibrator(), 16, 17)
    head = eagle_head(target)  # built once per shape, outside every timed call
    methods = {
        "ours AR": lambda p, gen: ours(target, None, p, gen.max_new_tokens),
        "ours lookup (cost-aware K)": lambda p, gen: ours(target, LookupDrafter(max_cached_requests=0), p,
                                                          gen.max_new_tokens, cost),
        "ours draft model (K=4)": lambda p, gen: ours(target, DraftModel(draft), p, gen.max_new_tokens),
        "ours EAGLE-1 head (K=3)": lambda p, gen: ours(target, EagleDrafter(target, head), p, gen.max_new_tokens,
                                                       ConstantK(3)),
    }
    if kit.compile_backend != "none":  # the same decoder on the compiled static engine (CUDA graphs on a GPU)
        forward = compiled_forward(kit, target)
        label = "CUDA graphs" if kit.device.type == "cuda" else "compiled"
        methods[f"ours AR ({label})"] = lambda p, gen: ours(target, None, p, gen.max_new_tokens, forward=forward)
        methods[f"ours lookup (cost-aware K, {label})"] = lambda p, gen: ours(
            target, LookupDrafter(max_cached_requests=0), p, gen.max_new_tokens, cost, forward=forward)
    return methods


def _hf_methods(kit, target, draft, compiled: bool):
    methods = {
        "HF AR": lambda p, gen: hf_generate(target, p, gen, [], method="ar"),
        "HF assisted (draft, K=4)": lambda p, gen: hf_generate(target, p, gen, [], method="assisted",
                                                                  assistant_model=draft, num_draft_tokens=4),
        "HF prompt lookup (K=10)": lambda p, gen: hf_generate(target, p, gen, [], method="prompt_lookup",
                                                                num_draft_tokens=10),
    }
    if compiled:
        methods["HF static cache + compiled AR"] = lambda p, gen: (
            hf_static_compiled(target, p, gen, kit.compile_backend, kit.compile_mode), None)
    return methods


def _time_call(kit, fn, prompt, gen) -> tuple[float, object]:
    synchronize(kit.device)
    summary, (ids, stats) = time_ms(lambda: fn(prompt, gen), kit.device, repeats=1, warmup=0)
    return gen.max_new_tokens / (summary.median / 1000.0), stats


def speed(kit) -> dict:
    """tok/s (prefill included) of every method per speed shape, with peak memory, alpha, tau and the per-round
    split of ours (draft / verify / host overhead ms); the first speed shape also runs HF static-cache compiled AR
    (its compile time reported)."""
    out = {}
    gen = GenerationSpec(max_new_tokens=kit.new_tokens, ignore_eos=True)
    for index, name in enumerate(kit.speed_shapes):
        if kit.out_of_time(f"speed of {name}"):
            break
        target, draft = kit.model(name, kit.dtype), kit.model(kit.draft_shape, kit.dtype, seed=1)
        curve = kit.results.get("verify_cost", {}).get("result", {}).get(name, {}).get("batches", {}).get(1)
        cost_curve = measured_curve(curve["ms"], 17) if curve else VerifyCost([1.0] * 17, learn=False)
        prompts = [p.to(kit.device) for p in shapes.prompts(kit.tokenizer, kit.num_prompts, kit.prompt_tokens)]
        compiled = index == 0 and kit.compile_backend != "none"
        methods = {**_hf_methods(kit, target, draft, compiled), **_our_methods(kit, target, draft, cost_curve)}
        rows = {}
        for method, fn in methods.items():
            if kit.out_of_time(f"{method} on {name}"):
                continue
            row = rows.setdefault(method, {"tok_s": [], "alpha": [], "tau": [], "round_ms": [], "peaks": []})
            try:
                if method.startswith("HF static"):  # the first call compiles: timed apart, reported as such
                    began = time.perf_counter()
                    fn(prompts[0], gen)
                    synchronize(kit.device)
                    row["first_call_s"] = time.perf_counter() - began
                else:
                    fn(prompts[0], gen)  # warm-up
                with PeakMemory(str(kit.device)) as meter:
                    for prompt in prompts * kit.repeats:
                        tok_s, stats = _time_call(kit, fn, prompt, gen)
                        row["tok_s"].append(tok_s)
                        if stats is not None and method.startswith("ours"):
                            row["alpha"].append(stats.acceptance_rate)
                            row["tau"].append(stats.tokens_per_round)
                            row["round_ms"].append(stats.round_ms)
                row["peak"] = meter.result
            except Exception as exc:  # noqa: BLE001 - one method failing must not stop the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out[name] = {"rows": {m: _summarize(r) for m, r in rows.items()}}
            kit.partial("speed", out)
        if index == 0:
            rows.update(_batch_rows(kit, target, prompts, gen, cost_curve))
        out[name] = {"rows": {m: _summarize(r) for m, r in rows.items()}}
        del target, draft, methods, fn  # the next shape is built with this one's memory free (Kit.model drops it)
    return out


def _batch_rows(kit, target, prompts: list, gen: GenerationSpec, curve: VerifyCost) -> dict:
    """B = 8: HF batched AR (left-padded ``generate``) against our decoder over 8 rows (lookup, cost-aware K; on the
    compiled engine where the kit compiles), tok/s over all rows, the same prompts."""
    from eval.batch_run import hf_batch_generate

    batch = [p.cpu() for p in (prompts * 8)[:8]]
    forward = compiled_forward(kit, target) if kit.compile_backend != "none" else None
    methods = {
        "HF batched AR (B = 8)": lambda: hf_batch_generate(target, kit.tokenizer, batch, gen, [], 8),
        "ours batch of 8, lookup": lambda: ours_batch(target, lambda: LookupDrafter(max_cached_requests=0), batch,
                                                      gen.max_new_tokens,
                                                      CostAwareK(curve, Calibrator(), 8, 9), forward=forward),
    }
    rows = {}
    for method, fn in methods.items():
        if kit.out_of_time(method):
            continue
        row = rows.setdefault(method, {"tok_s": [], "alpha": [], "tau": [], "round_ms": [], "peaks": []})
        try:
            fn()  # warm-up (and the compile)
            for _ in range(kit.repeats):
                synchronize(kit.device)
                summary, _ = time_ms(fn, kit.device, repeats=1, warmup=0)
                row["tok_s"].append(len(batch) * gen.max_new_tokens / (summary.median / 1000.0))
        except Exception as exc:  # noqa: BLE001 - one method failing must not stop the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rows


def _summarize(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k not in ("tok_s", "alpha", "tau", "round_ms", "peaks")}
    if row["tok_s"]:
        out["tok_s"] = statistics.median(row["tok_s"])
        out["tok_s_min"], out["tok_s_max"] = min(row["tok_s"]), max(row["tok_s"])
    if row["alpha"]:
        out["alpha"], out["tau"] = statistics.median(row["alpha"]), statistics.median(row["tau"])
        for key in ("draft", "target", "overhead", "overhead_pct"):
            out[f"round_{key}"] = statistics.median(r[key] for r in row["round_ms"])
    return out


def _cost_at(curve: VerifyCost, width: float) -> float:
    """ms of a verify over a (fractional, mean) ``width``: linear between the curve's whole widths."""
    low = max(1, int(width))
    return curve.ms(low) + (curve.ms(low + 1) - curve.ms(low)) * (width - low)


def projection(kit, root: Path) -> dict:
    """Projected speedup over our own AR on each speed shape, per CPU-measured recipe: ``tau / ((cost(w) +
    drafting) / cost(1))`` (Leviathan et al. 2023), where tau and alpha come from the committed CPU reports (real
    weights), ``w = 1 + (tau - 1) / alpha`` is the mean verify width, ``cost`` is this device's verify curve at
    B = 1, and drafting is free for lookup and the measured head step for EAGLE. Projections, not measurements."""
    curves = {name: measured_curve(data["batches"][1]["ms"])
              for name, data in kit.results.get("verify_cost", {}).get("result", {}).items() if 1 in data["batches"]}
    sources = []
    main = root / "bench/reports/main/main_bench.json"
    if main.is_file():
        for run in json.loads(main.read_text())["runs"]:
            sources.append((f"{run['recipe']} (lookup) on {run['suite']}", run["alpha"], run["tau"], False))
    eagle = root / "bench/reports/eagle3/eagle_bench.json"
    if eagle.is_file():
        for suite, data in json.loads(eagle.read_text())["suites"].items():
            for head, alpha in data["eagle_alpha"].items():
                sources.append((f"{head} on {suite}", alpha, data["eagle_tau"][head], True))
    out = {}
    for name, curve in curves.items():
        head_ms = kit.head_step_ms(name)
        rows = []
        for label, alpha, tau, drafts_with_head in sources:
            width = 1 + (tau - 1) / alpha if alpha > 0 else 1
            row = {"source": label, "alpha": alpha, "tau": tau, "mean_verify_width": width,
                   "projected_speedup_vs_our_ar": None}
            if drafts_with_head and not head_ms:
                row["note"] = "no head step measured on this shape (speed stage skipped or failed)"
            else:
                drafting = (width - 1) * head_ms if drafts_with_head else 0.0
                row["projected_speedup_vs_our_ar"] = tau / ((_cost_at(curve, width) + drafting) / curve.ms(1))
            rows.append(row)
        out[name] = rows
    return out
