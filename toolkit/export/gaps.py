"""What a serving engine cannot express of a recipe: one warning per recipe field, shared by every exporter.

What a drafter is to the engines (its method name, its parameters, whether it runs a draft LM) comes from its
registered config (:mod:`toolkit.speculative.drafters.registry`), never from comparing drafter names.
"""

from __future__ import annotations

from toolkit.speculative.drafters.registry import DRAFT_TARGET, DRAFT_UNUSED

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the checkpoint the embedded GGUF was made from

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
#: the engines' ``dtype`` for each target precision (int8 / int4 load in-flight quantized, dtype picked by the engine)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "auto", "int4": "auto"}


def target_config(recipe, model_key: str, warnings: list[str]) -> dict:
    """The engine arguments every exporter shares: the model (under ``model_key``), dtype, quantization, KV dtype."""
    config: dict = {model_key: model_path(recipe.target, "target", warnings), "dtype": DTYPES[recipe.target.precision]}
    if recipe.target.precision in ("int8", "int4"):
        config["quantization"] = "bitsandbytes"
    config["kv_cache_dtype"] = "auto"
    return config


def engine_warnings(recipe, engine: str) -> list[str]:
    """Everything of ``recipe`` that ``engine`` cannot express: target, speculation, KV caches, generation."""
    return (target_warnings(recipe, engine) + spec_warnings(recipe, engine) + kv_warnings(recipe, engine)
            + generation_warnings(recipe))


def model_path(spec, prefix: str, warnings: list[str]) -> str:
    """The engine's model argument for a ``ModelSpec`` (``embedded`` maps to its hub checkpoint)."""
    if spec.source == "embedded":
        warnings.append(f"{prefix}.source: 'embedded' is the Q4_1 GGUF of {EMBEDDED_HUB_ID} dequantized; the "
                        f"engine loads the original hub checkpoint {EMBEDDED_HUB_ID} (higher precision, so outputs "
                        "can differ slightly from this toolkit's)")
        return EMBEDDED_HUB_ID
    if spec.source.endswith(".gguf"):
        warnings.append(f"{prefix}.source: a .gguf file; the engine's GGUF support is partial — prefer the "
                        "original HF checkpoint")
    return spec.source


def draft_source(recipe) -> tuple:
    """``(ModelSpec, role)`` of the draft LM a drafter runs: the target's own checkpoint for a drafter that drafts
    with the target's weights (``self``), else the recipe's ``draft`` section."""
    if recipe.spec.config.draft == DRAFT_TARGET:
        return recipe.target, "target"
    return recipe.draft, "draft"


def eagle_variant(recipe) -> str:
    """``"eagle3"`` when the recipe's head directory holds an EAGLE-3 head, else ``"eagle"`` (EAGLE-1, also when the
    head cannot be read here). Read from the head's ``config.json`` the way :func:`toolkit.eagle.checkpoint.save_head`
    writes it (``toolkit_eagle.variant``) or the published layouts name it (``architectures``: ``...Eagle3``)."""
    import json
    from pathlib import Path

    from toolkit.eagle.checkpoint import SHIPPED

    if recipe.draft is None:
        return "eagle"
    path = SHIPPED.get(recipe.draft.source, Path(str(recipe.draft.source)).expanduser()) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return "eagle"
    variant = (raw.get("toolkit_eagle") or {}).get("variant")
    if variant is None:
        variant = "eagle3" if any("Eagle3" in a for a in raw.get("architectures") or []) else "eagle1"
    return "eagle3" if variant == "eagle3" else "eagle"


def kv_warnings(recipe, engine: str) -> list[str]:
    """Our KV-cache compression policies have no counterpart in the engines' paged caches."""
    name = ENGINE_NAMES[engine]
    out = []
    for prefix, kv in (("kv", recipe.kv), ("draft_kv", recipe.draft_kv)):
        if kv.policy == "none":
            continue
        if prefix == "draft_kv" and recipe.spec.config.draft == DRAFT_UNUSED:
            continue
        params = ", ".join(f"{k}={v}" for k, v in kv.params.items())
        what = {"streaming": "StreamingLLM eviction (attention sinks + window)",
                "l2norm": "L2-norm key eviction", "head_aware": "head-aware per-head budgets",
                "quantized": "KIVI-style quantized KV (int keys per channel / values per token)"}.get(kv.policy,
                                                                                                 kv.policy)
        hint = ""
        if kv.policy == "quantized":
            hint = " (closest engine option: kv_cache_dtype fp8, a different format; not set here)"
        out.append(f"{prefix}.policy: {kv.policy} ({params}) — {what} cannot be expressed in {name}; the engine "
                   f"keeps the full KV cache (memory will be higher than measured here){hint}")
    return out


def spec_warnings(recipe, engine: str) -> list[str]:
    name = ENGINE_NAMES[engine]
    s = recipe.spec
    out = []
    if s.adaptive != "constant":
        out.append(f"spec.adaptive: {s.adaptive} (K in [{s.k_min}, {s.k_max}]) — adaptive draft length is not "
                   f"expressed; exported a constant K = spec.num_draft_tokens = {s.num_draft_tokens}")
    out += [f"spec.{field}: {what} has no {name} setting" for field, what in s.config.engine_gaps()]
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
    if backend not in (None, "auto", "bitsandbytes") and t.precision in ("int8", "int4"):
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
