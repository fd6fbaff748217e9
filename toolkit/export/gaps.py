"""What a serving engine cannot express of a recipe: one warning per recipe field, shared by every exporter."""

from __future__ import annotations

from toolkit.export.common import ENGINE_NAMES
from toolkit.kv.registry import NONE, policy_info
from toolkit.quant import AUTO, QUANTIZED, backend_names, weight_backend
from toolkit.speculative.drafters.registry import DRAFT_TARGET, DRAFT_UNUSED


def engine_warnings(recipe, engine: str) -> list[str]:
    """Everything of ``recipe`` that ``engine`` cannot express: target, speculation, KV caches, generation."""
    return (target_warnings(recipe, engine) + spec_warnings(recipe, engine) + kv_warnings(recipe, engine)
            + generation_warnings(recipe))


def kv_warnings(recipe, engine: str) -> list[str]:
    """Our KV-cache compression policies have no counterpart in the engines' paged caches."""
    name = ENGINE_NAMES[engine]
    out = []
    for prefix, kv in (("kv", recipe.kv), ("draft_kv", recipe.draft_kv)):
        if kv.policy == NONE:
            continue
        if prefix == "draft_kv" and recipe.spec.config.draft == DRAFT_UNUSED:
            continue
        params = ", ".join(f"{k}={v}" for k, v in kv.params.items())
        info = policy_info(kv.policy)
        hint = f" ({info.engine_hint})" if info.engine_hint else ""
        out.append(f"{prefix}.policy: {kv.policy} ({params}) — {info.summary} cannot be expressed in {name}; the "
                   f"engine keeps the full KV cache (memory will be higher than measured here){hint}")
    return out


def spec_warnings(recipe, engine: str) -> list[str]:
    name = ENGINE_NAMES[engine]
    s = recipe.spec
    out = []
    if s.adaptive != "constant":
        span = f"K in [{s.k_min}, {s.k_max}]" if s.adaptive == "ema" else \
            f"verify length 1..{s.num_draft_tokens} by the measured cost curve"
        out.append(f"spec.adaptive: {s.adaptive} ({span}) — adaptive draft length is not "
                   f"expressed; exported a constant K = spec.num_draft_tokens = {s.num_draft_tokens}")
    out += [f"spec.{field}: {what} has no {name} setting" for field, what in s.config.engine_gaps(engine)]
    if s.config.draft == DRAFT_TARGET:
        out.append(f"spec.drafter: {s.drafter} — the target's own weights at draft.precision="
                   f"{recipe.draft.precision} are exported as a separate draft model (the same checkpoint, loaded "
                   "twice)")
    if s.config.uses_draft_model and recipe.draft.precision == "int4":
        out.append(f"draft.precision: int4 (bitsandbytes NF4) — {name} cannot quantize a draft model to NF4 on "
                   "the fly; the draft runs at the engine's dtype unless you pass a pre-quantized draft checkpoint")
    if s.config.uses_draft_model and recipe.draft.precision == "int8":
        out.append(f"draft.precision: int8 (bitsandbytes LLM.int8()) — not expressible for a {name} draft; the "
                   "draft runs at the engine's dtype unless you pass a pre-quantized draft checkpoint")
    return out


def target_warnings(recipe, engine: str) -> list[str]:
    t = recipe.target
    out = []
    if t.precision == "int8":
        out.append("target.precision: int8 (LLM.int8()) — engines load 8-bit bitsandbytes only from a "
                   "pre-quantized checkpoint; in-flight bitsandbytes quantization is 4-bit (NF4) "
                   "[uncertain: check your engine version]")
    if t.precision in ("int8", "int4") and t.int8_threshold != 6.0:
        out.append(f"target.int8_threshold: {t.int8_threshold} — not expressible (engines use the default 6.0)")
    if t.precision == "int4" and not t.int4_double_quant:
        out.append("target.int4_double_quant: false — engines use their own bitsandbytes NF4 settings")
    backend = t.backend
    in_flight = backend in backend_names() and weight_backend(backend).engine_in_flight  # engines quantize it so too
    if backend not in (None, AUTO) and not in_flight and t.precision in QUANTIZED:
        out.append(f"target.backend: {backend} — exported as bitsandbytes quantization; the engine's own {backend} "
                   "path needs a checkpoint quantized with it")
    if t.precision == "fp16" and t.device == "cpu":
        out.append("target.precision: fp16 on CPU — slow in this toolkit; engines on GPU are fine")
    return out


def generation_warnings(recipe) -> list[str]:
    g = recipe.generation
    out = []
    if g.ignore_eos:
        out.append("generation.ignore_eos: true — set ignore_eos=True in the request's sampling parameters")
    if g.stop_strings:
        out.append(f"generation.stop_strings: {g.stop_strings} — pass as 'stop' in each request")
    return out
