"""Stage ``kv_long``: KV-cache compression at long context, through the toolkit's own API (``toolkit.build`` of a
recipe per policy, the decoding path the toolkit picks for it reported as its ``engine_note`` line).

Contexts of 8k and 32k tokens on the 1B shape and 8k on the 8B shape (random weights, bf16; the dry run: ``tiny``,
64 and 128), B = 1 and 8 rows, ``new`` tokens per row, greedy, EOS off. Per (shape, context, B):

* policies of :func:`policies`: none, StreamingLLM (4 sinks + a window of 1/8 of the context; right after it the
  same with the prompt in one forward under the window's mask instead of the chunks of
  :mod:`toolkit.kv.window_prefill`, the A/B of that choice on the device), L2-norm eviction, KIVI-2, head-aware
  eviction (budgets 1/8 of the context) and KIVI-4 (KIVI: groups of 64, 128 residual tokens) — AR on the
  target's compressed cache (``spec.drafter: none``), ``compile: auto`` (the static engine where the policy has a
  static form, else the eager per-row caches: the path line says which);
* at B = 1, self-speculation with a compressed draft cache (MagicDec / QuantSpec style: ``drafter: self``, the target
  drafting K = 4 over a StreamingLLM or KIVI-4 view of its own KV, the target's cache uncompressed, so the output is
  the target's own greedy output) — random weights accept little: acceptance at long context from the real model is
  a CPU measurement (``bench/reports/batch``), so these rows' speed is a lower bound, said in the report;
* HF baselines on the uncompressed cache: eager batched ``generate`` and HF static-cache compiled ``generate``
  (``reduce-overhead``) over the same rows (equal-length prompts: no padding), with the static cache length HF was
  given (prompt + new tokens) recorded.

Each row: tok/s over all rows (prefill included), the prefill's seconds and the decode's tok/s (the tokens after
each row's first over the time after the prefills: what a compressed cache speeds up; at 32k tokens and 64 new ones
the prefill is most of the wall time — H100, 2026-11-27: the uncompressed row took 2.9 s at B = 8, of which its
63 decode steps, each reading ~11 GB of weights and KV, account for ~0.3 s by the device's bandwidth), KV bytes of the
target's cache at the end (``stats.kv_bytes_target`` summed over rows), peak device memory, α / τ where a drafter
runs. The issue's target (a compressed cache >= 1.5x the uncompressed) is read on the decode's tok/s.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import torch

from eval.metrics import PeakMemory
from gpu_kit import shapes
from toolkit.measure.timing import synchronize, time_ms
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec

ROOT = Path(__file__).resolve().parents[2]
#: the head-aware policy calibrates on these files of the repository (they travel with the tree)
CALIBRATION = [str(ROOT / "docs/design.md"), str(ROOT / "README.md")]


def policies(context: int) -> dict[str, dict]:
    """``{label: {"kv": KVSpec, "draft_kv": KVSpec | None}}`` in the order they run (the target's candidates, at most
    25% of the uncompressed bytes, first); ``draft_kv`` set: self-speculation over that draft cache (B = 1 rows only).
    Budgets: 1/8 of ``context``."""
    budget = max(context // 8, 16)
    recent = min(32, budget // 4)
    kivi = {"quant_group_size": 64 if context >= 1024 else 8, "residual_length": 128 if context >= 1024 else 8}
    return {
        "none": {"kv": KVSpec("none", {})},
        f"StreamingLLM (4 sinks + {budget - 4})": {"kv": KVSpec("streaming", {"sink_tokens": 4,
                                                                                "window": budget - 4})},
        f"StreamingLLM (4 sinks + {budget - 4}), prompt in one masked forward": {
            "kv": KVSpec("streaming", {"sink_tokens": 4, "window": budget - 4}), "whole_prompt": True},
        f"L2-norm (budget {budget})": {"kv": KVSpec("l2norm", {"budget": budget, "protect_recent": recent})},
        "KIVI-2": {"kv": KVSpec("quantized", {"quant_bits": 2, **kivi})},
        f"head-aware (budget {budget})": {"kv": KVSpec("head_aware", {
            "budget": budget, "protect_recent": recent, "tiers": 2, "calibration_files": CALIBRATION,
            "calibration_tokens": 512})},
        "KIVI-4": {"kv": KVSpec("quantized", {"quant_bits": 4, **kivi})},  # 28% of the bytes at 32k: no candidate
        "self-speculation, draft over StreamingLLM (K=4)": {"kv": KVSpec("none", {}), "draft_kv": KVSpec(
            "streaming", {"sink_tokens": 4, "window": budget - 4})},
        "self-speculation, draft over KIVI-4 (K=4)": {"kv": KVSpec("none", {}), "draft_kv": KVSpec(
            "quantized", {"quant_bits": 4, **kivi})},
    }


def recipe_for(label: str, entry: dict, new: int) -> Recipe:
    """The recipe of one policy row: the passed-in target (``source`` is a placeholder: nothing loads), AR or
    self-speculation, ``compile: auto``."""
    selfspec = entry.get("draft_kv") is not None
    return Recipe(name="kv-long", target=ModelSpec(source="embedded", precision="bf16"),
                  draft=ModelSpec(source="embedded", precision="bf16") if selfspec else None,
                  kv=entry["kv"], draft_kv=entry.get("draft_kv") or KVSpec("none", {}),
                  spec=SpeculationSpec("self", 4, "constant") if selfspec else SpeculationSpec("none", 4),
                  generation=GenerationSpec(max_new_tokens=new, ignore_eos=True), compile="auto")


def ours_row(kit, model, label: str, entry: dict, prompts: list, new: int) -> dict:
    """One policy: build the recipe on ``model``, one untimed call (compiles, calibrates), one timed call (with
    ``whole_prompt``, a StreamingLLM prompt in one masked forward, as before :mod:`toolkit.kv.window_prefill`)."""
    from toolkit.kv import window_prefill

    if entry.get("whole_prompt"):
        saved = dict(window_prefill.CHUNK_TOKENS)
        window_prefill.CHUNK_TOKENS.update(cpu=None, other=None)
        try:
            return ours_row(kit, model, label, {k: v for k, v in entry.items() if k != "whole_prompt"}, prompts, new)
        finally:
            window_prefill.CHUNK_TOKENS.update(saved)
    import toolkit

    selfspec = entry.get("draft_kv") is not None
    # the draft: a copy of the target's weights (one module object cannot run both engines' attention at once)
    lm = toolkit.build(recipe_for(label, entry, new), target=model, tokenizer=kit.tokenizer,
                       draft_model=copy.deepcopy(model) if selfspec else None)
    lm.generate_batch(prompts, batch_size=len(prompts))  # warm-up (compile / calibration / CUDA graph capture)
    synchronize(kit.device)
    with PeakMemory(str(kit.device)) as meter:
        summary, results = time_ms(lambda: lm.generate_batch(prompts, batch_size=len(prompts)), kit.device,
                                   repeats=1, warmup=0)
    stats = [r.stats for r in results]
    prefill_ms = sum(s.ttft_ms for s in stats)  # the rows are prefilled one after another, then decode together
    row = {"path": lm.engine_note, "tok_s": sum(len(r.token_ids) for r in results) / (summary.median / 1000.0),
           **decode_rate(sum(len(r.token_ids) - 1 for r in results), summary.median, prefill_ms),
           "kv_bytes": sum(s.kv_bytes_target for s in stats), "peak": meter.result}
    if selfspec:
        row["alpha"] = sum(s.acceptance_rate for s in stats) / len(stats)
        row["tau"] = sum(s.tokens_per_round for s in stats) / len(stats)
        row["note"] = "random weights: acceptance says nothing of real text (a lower bound on speed)"
    return row


def decode_rate(decoded: int, total_ms: float, prefill_ms: float) -> dict:
    """``{"prefill_s", "decode_tok_s"}``: ``decoded`` tokens (those after each row's first) over the ``total_ms -
    prefill_ms`` a call spent past its prefill (``decode_tok_s`` ``None`` when nothing was left to time)."""
    decode_ms = total_ms - prefill_ms
    return {"prefill_s": prefill_ms / 1000.0,
            "decode_tok_s": decoded / (decode_ms / 1000.0) if decoded > 0 and decode_ms > 0 else None}


def hf_rows(kit, model, prompts: list, new: int) -> dict:
    """HF eager batched AR and HF static-cache compiled AR over the same rows (one ``generate`` over all rows); the
    prefill's time is a ``generate`` of one new token over the same rows (after the timed call)."""
    from toolkit.measure.baselines import _static_compiled

    batch = torch.cat(prompts).to(kit.device)
    out = {}
    for name, static in (("HF batched AR (eager)", False), ("HF static cache + compiled AR (batched)", True)):
        if kit.out_of_time(name):
            break
        config = _generation_config(model, new)
        if static:
            _static_compiled(config, batch.shape[1] + new, kit.compile_backend, kit.compile_mode)
        try:
            call = lambda: model.generate(batch, attention_mask=torch.ones_like(batch),  # noqa: E731
                                          generation_config=config)
            first = copy.deepcopy(config)
            first.max_new_tokens = 1
            with torch.no_grad():
                call()  # warm-up / compile
                with PeakMemory(str(kit.device)) as meter:
                    summary, _ = time_ms(call, kit.device, repeats=1, warmup=0)
                prefill, _ = time_ms(lambda: model.generate(batch, attention_mask=torch.ones_like(batch),
                                                            generation_config=first), kit.device, repeats=1,
                                     warmup=0)
            out[name] = {"tok_s": batch.shape[0] * new / (summary.median / 1000.0), "peak": meter.result,
                         **decode_rate(batch.shape[0] * (new - 1), summary.median, prefill.median),
                         "path": "HF generate" + (f", static cache of {batch.shape[1] + new} positions, "
                                                  f"compiled ({kit.compile_backend}, {kit.compile_mode})"
                                                  if static else ", dynamic cache, eager")}
            if static:
                out[name]["static_cache_len"] = batch.shape[1] + new
        except Exception as exc:  # noqa: BLE001 - a baseline failing must not stop the stage
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def _generation_config(model, new: int):
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = new, None, False
    config.eos_token_id, config.pad_token_id = [], 0
    return config


def plan(kit) -> list[tuple[str, int, int]]:
    """(shape, context, rows) in the stage's order: the GPU issue's target first (1B, 32k, B = 8)."""
    if kit.dry_run:
        return [("tiny", 128, 2), ("tiny", 64, 1)]
    return [("llama-3.2-1b", 32768, 8), ("llama-3.2-1b", 32768, 1), ("llama-3.2-1b", 8192, 8),
            ("llama-3.2-1b", 8192, 1), ("llama-3.1-8b", 8192, 8), ("llama-3.1-8b", 8192, 1)]


def kv_long(kit) -> dict:
    """Every (shape, context, B) of :func:`plan` and every policy, in the time left; saved after each row."""
    new = kit.new_tokens
    out = {"new_tokens": new, "runs": {}}
    model, built = None, None
    for shape, context, rows in plan(kit):
        key = f"{shape}, {context} tokens, B = {rows}"
        if kit.out_of_time(key):
            break
        if built != shape:
            model = built = None
            gc.collect()
            if kit.device.type == "cuda":
                torch.cuda.empty_cache()
            model = shapes.build(shape, kit.device, torch.bfloat16, max_positions=max(2 * context, 4096))
            built = shape
        prompts = [p for p in shapes.prompts(kit.tokenizer, rows, context)]
        run = out["runs"].setdefault(key, {"rows": {}})
        for label, entry in policies(context).items():
            if entry.get("draft_kv") is not None and rows > 1:
                continue  # a compressed draft cache decodes one row at a time: B = 1 only
            if kit.out_of_time(f"{key}: {label}"):
                break
            run["rows"][label] = kit.row(f"kv_long {key}: {label}", ours_row, kit, model, label, entry, prompts, new)
            kit.partial("kv_long", out)
        run["rows"].update(hf_rows(kit, model, prompts, new))
        kit.partial("kv_long", out)
    return out
