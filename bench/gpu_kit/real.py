"""The kit's real-weight speed stage: the embedded SmolLM2-135M-Instruct (from the relayed GGUF, cast to the kit's
dtype on the device) on the repeated-request suite (``recipes/prompts/repeat.yaml``: each request asked, then asked
again with an edit, in order), where the lookup drafter's acceptance is real, not that of random weights.

Per method, one untimed pass over the suite (compiles, CUDA graph captures; none on an eager CPU run), then one timed
pass with a fresh drafter whose memory persists across the suite's requests (the recipe's lookup:
``max_cached_requests`` 16, cost-aware K up to 16 on the embedded model's own verify curve, measured first). tok/s =
new tokens of the pass / its seconds (prefill included); per-request tok/s are kept too. Greedy, EOS off, the same
``max_new_tokens`` for every method, on the same weights.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from gpu_kit.checks import compare, ours
from gpu_kit.speed import curve_ms, measured_curve
from toolkit.engine.planner import CostAwareK
from toolkit.measure.baselines import hf_generate
from toolkit.measure.prompts import load_suite
from toolkit.measure.timing import synchronize
from toolkit.recipe import GenerationSpec
from toolkit.requests import encode
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import LookupDrafter
from toolkit.speculative.stats import acceptance_summary
from toolkit.speculative.verify_length import Calibrator

#: new tokens per request on a GPU (the ``short`` recipe's 128; on a CPU the kit's ``new_tokens``)
NEW_TOKENS = 128


def speed_real(kit) -> dict:
    """tok/s of HF static-cache compiled AR, HF prompt lookup and ours (AR and lookup, on the compiled engine where the
    kit compiles) on the embedded model over the repeated-request suite; α and τ of our lookup; whether our lookup's
    tokens equal our AR's on the same engine (first divergence: bf16 verify widths run other kernels than one-token
    steps, so a near-tie may flip). Raises ``RuntimeError`` when the embedded model was not relayed."""
    real = kit.embedded
    if real is None:
        raise RuntimeError("the embedded model was not relayed (bench/README.md): no real-weight speed")
    dtype = torch.float32 if kit.dry_run else kit.dtype  # bf16 matmuls are slow on CPUs
    model = copy.deepcopy(real[0]).to(dtype)
    tok = real[1]
    suite = load_suite("repeat")[: 2 if kit.dry_run else None]
    prompts = [encode(tok, "embedded", p.prompt).to(kit.device) for p in suite]
    gen = GenerationSpec(max_new_tokens=NEW_TOKENS if kit.device.type == "cuda" else kit.new_tokens, ignore_eos=True)
    compiled = kit.compile_backend != "none" and not kit.dry_run  # the dry run's speed stage traces the engine
    forward = kit.compiled(model) if compiled else None
    curve, curve_points = _curve(kit, forward)
    methods = {"HF prompt lookup (K=10)": lambda: _hf(model, gen, "prompt_lookup"),
               "ours AR": lambda: _ours(model, gen, None, None, forward),
               "ours lookup (cost-aware K)": lambda: _ours(model, gen, LookupDrafter(),
                                                           CostAwareK(curve, Calibrator(), 16, 17), forward)}
    if compiled:  # one cache size for every request: one compiled decoding step
        longest = max(p.shape[1] for p in prompts) + gen.max_new_tokens
        methods["HF static cache + compiled AR"] = lambda: _hf(model, gen, "ar_static", kit, longest)
    rows, tokens = {}, {}
    out = {"model": "embedded SmolLM2-135M-Instruct", "dtype": str(dtype), "suite": "repeat",
           "requests": len(prompts), "max_new_tokens": gen.max_new_tokens,
           "path": "CUDA graphs" if compiled and kit.device.type == "cuda" else "compiled" if compiled else "eager",
           "verify_ms_b1": curve_points, "rows": rows, "lookup_equals_ar": None}
    for method, make in methods.items():
        if kit.out_of_time(f"{method} on the embedded model"):
            continue
        try:
            if compiled or kit.device.type == "cuda":
                make()(prompts)  # untimed: compiles, captures, CUDA's first-call costs (an eager CPU run has none)
            rows[method], tokens[method] = make()(prompts)
        except Exception as exc:  # noqa: BLE001 - one method failing must not stop the others
            rows[method] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        kit.partial("speed_real", out)
    if "ours AR" in tokens and "ours lookup (cost-aware K)" in tokens:
        pairs = zip(tokens["ours lookup (cost-aware K)"], tokens["ours AR"])
        out["lookup_equals_ar"] = [compare(a, b) for a, b in pairs]
    kit.forget(model)  # its compiled forward and static cache
    return out


def _curve(kit, forward) -> tuple[VerifyCost, dict]:
    """The embedded model's own verify curve at B = 1 (measured here through ``forward``: 1..16 tokens after 256 of
    context), which its cost-aware K reads; flat where the kit does not compile. Returns it and its ``{n: ms}``."""
    if forward is None:
        return VerifyCost([1.0] * 17, learn=False), {}
    ms = curve_ms(kit, forward, 1, 256, [w for w in (1, 2, 4, 8, 16) if w <= max(kit.widths)])
    return measured_curve(ms, 17), ms


def _pass(kit_device, run):
    """Time ``run(prompt)`` over every prompt in order; ``(row, tokens)`` with tok/s over the pass."""
    def timed(prompts):
        per, out, stats_all, total_s = [], [], [], 0.0
        for prompt in prompts:
            synchronize(kit_device)
            began = time.perf_counter()
            ids, stats = run(prompt)
            synchronize(kit_device)
            seconds = time.perf_counter() - began
            total_s += seconds
            per.append(len(ids) / seconds)
            out.append(ids)
            if stats is not None:
                stats_all.append(stats)
        row = {"tok_s": sum(len(t) for t in out) / total_s, "tok_s_per_request_median": statistics.median(per)}
        if stats_all:
            summary = acceptance_summary(stats_all)
            row["alpha"], row["tau"] = summary["acceptance_rate"], summary["tokens_per_round"]
        return row, out
    return timed


def _hf(model, gen, method: str, kit=None, max_cache_len: int | None = None):
    device = next(model.parameters()).device
    options = {"compile_backend": kit.compile_backend, "compile_mode": kit.compile_mode} if kit else {}
    return _pass(device, lambda p: (hf_generate(model, p, gen, [], method=method, num_draft_tokens=10,
                                                max_cache_len=max_cache_len, **options)[0], None))


def _ours(model, gen, drafter, controller, forward):
    device = next(model.parameters()).device
    return _pass(device, lambda p: ours(model, drafter, p, gen.max_new_tokens, controller, forward=forward))

