"""Stage ``drafters_real``: drafters that run a network, on the real embedded model (the relayed GGUF, bf16 on the
GPU), on prompts no head saw in training (the shipped head's held-out prompts, ``data_files.json``), through the
toolkit's own recipes (``toolkit.build``, ``compile: auto``: CUDA graphs where the engine can run them; the path line
of each recipe is reported, with the per-round split: draft / verify / host overhead ms).

Rows, in this order: HF static-cache compiled AR (the baseline), the shipped trained EAGLE-1 head
(``toolkit/heads/smollm2-135m-instruct``) as a K = 3 chain, ours AR, HF assisted generation with the draft model, the
draft model (the embedded model at int4, torchao on CUDA) as a K = 4 chain and as a token tree, the head as a tree.
Per row: tok/s over the prompts (after one untimed pass), α, τ, the per-round split, and tokens identical to ours AR
(bf16: a near-tie may flip).
:func:`measure_head` runs the same rows for any head directory (the ``eagle_train`` stage's head).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import torch

from toolkit.measure.timing import synchronize
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec
from toolkit.speculative.stats import round_summary

SHIPPED = Path(__file__).resolve().parents[2] / "toolkit" / "heads" / "smollm2-135m-instruct"


def heldout_prompts(head_dir: Path, count: int) -> list[list[dict]]:
    """The first ``count`` held-out prompts of a head's training data (never trained on), as one-message chats."""
    data = json.loads((head_dir / "data_files.json").read_text()) if (head_dir / "data_files.json").is_file() \
        else json.loads((head_dir / "data" / "eagle_manifest.json").read_text())
    return [[{"role": "user", "content": text}] for text in data["heldout_prompts"][:count]]


def _recipe(drafter: str, k: int, tree: bool, draft: ModelSpec | None, new: int) -> Recipe:
    tree_fields = {"tree": True, "tree_budget": 16, "tree_depth": 5, "tree_topk": 4} if tree else {}
    return Recipe(name=f"real-{drafter}", target=ModelSpec(source="embedded", precision="bf16"), draft=draft,
                  kv=KVSpec("none", {}), draft_kv=KVSpec("none", {}),
                  spec=SpeculationSpec(drafter, k, "constant", **tree_fields),
                  generation=GenerationSpec(max_new_tokens=new, ignore_eos=True), compile="auto")


def ours_pass(lm, prompts: list, device) -> dict:
    """One untimed pass over ``prompts`` then one timed: tok/s of the pass (prefill included), its prefill seconds and
    decode tok/s (:func:`gpu_kit.kv_long.decode_rate`), α, τ, the mean round split, the ids,
    the untimed pass's seconds (the compile and the CUDA graph captures are in it) and what dynamo and the CUDA graph
    trees did in each pass (graphs compiled, graph breaks, graphs declined: a timed pass that compiles or declines
    is not running on captured graphs; the H100's EAGLE-3 round of 2026-11-27 came without these)."""
    from gpu_kit.kv_long import decode_rate
    from gpu_kit.weights import compile_counts

    before = compile_counts()
    began = time.perf_counter()
    for prompt in prompts:
        lm.generate(prompt)
    synchronize(device)
    first_pass_s = time.perf_counter() - began
    between = compile_counts()
    results = [lm.generate(prompt) for prompt in prompts]
    after = compile_counts()
    stats = [r.stats for r in results]
    seconds = sum(s.total_ms for s in stats) / 1000.0
    return {"tok_s": sum(len(r.token_ids) for r in results) / seconds, "path": lm.engine_note,
            **decode_rate(sum(len(r.token_ids) - 1 for r in results), seconds * 1000.0,
                          sum(s.ttft_ms for s in stats)),
            "alpha": statistics.mean(s.acceptance_rate for s in stats),
            "tau": statistics.mean(s.tokens_per_round for s in stats), "round_ms": round_summary(stats),
            "ids": [r.token_ids for r in results], "first_pass_s": first_pass_s,
            "compiles": {"untimed": {k: between[k] - before[k] for k in before},
                         "timed": {k: after[k] - between[k] for k in before}}}


def hf_pass(model, tok, prompts: list, new: int, method: str, kit, **kwargs) -> dict:
    """HF ``generate`` (``method`` of :func:`toolkit.measure.baselines.hf_generate`) over ``prompts``, one untimed
    pass first (the compile of ``ar_static``). ``ar_static`` gets one static cache length for every prompt (the
    longest prompt + ``new``): a length per prompt recompiled HF's step once per prompt (329 s for 8 prompts on an
    H100, 2026-11-27, and dynamo's recompile limit then leaves later prompts eager)."""
    from toolkit.measure.baselines import hf_generate
    from toolkit.requests import encode

    gen = GenerationSpec(max_new_tokens=new, ignore_eos=True)
    ids = [encode(tok, "embedded", p).to(kit.device) for p in prompts]
    options = dict(compile_backend=kit.compile_backend, compile_mode=kit.compile_mode, **kwargs)
    if method == "ar_static":
        options["max_cache_len"] = max(x.shape[1] for x in ids) + new
    for x in ids:
        hf_generate(model, x, gen, [], method=method, **options)
    runs = [hf_generate(model, x, gen, [], method=method, **options) for x in ids]
    return {"tok_s": sum(len(r[0]) for r in runs) / (sum(r[1].total_ms for r in runs) / 1000.0),
            "path": f"HF generate ({method})"}


def _rows(kit, target, tok, draft, head, new: int) -> dict:
    """``{label: () -> row}`` in the order they run: HF's baseline, the head's chain, ours AR, the draft model's
    rows, the head's tree."""
    import toolkit

    def ours(recipe, draft_model=None):
        return lambda prompts: ours_pass(toolkit.build(recipe, target=target, tokenizer=tok,
                                                       draft_model=draft_model), prompts, kit.device)

    rows = {"HF static cache + compiled AR": lambda p: hf_pass(target, tok, p, new, "ar_static", kit)}
    if head is not None:  # the head's chain next: the row a capped call must not lose
        head_spec = ModelSpec(source=str(head[0]), precision="bf16")
        rows[f"ours EAGLE ({head[2]}), K=3"] = ours(_recipe("eagle", 3, False, head_spec, new), head[1])
    rows["ours AR"] = ours(_recipe("none", 4, False, None, new))
    if draft is not None:
        spec = ModelSpec(source="embedded", precision="int4" if kit.device.type == "cuda" else "bf16")
        rows["HF assisted (draft model, K=4)"] = lambda p: hf_pass(target, tok, p, new, "assisted", kit,
                                                                    assistant_model=draft, num_draft_tokens=4)
        rows["ours draft model, K=4"] = ours(_recipe("draft_model", 4, False, spec, new), draft)
        rows["ours draft model, tree (16, depth 5, top-4)"] = ours(_recipe("draft_model", 4, True, spec, new), draft)
    if head is not None:
        rows[f"ours EAGLE ({head[2]}), tree (16, depth 5, top-4)"] = ours(_recipe("eagle", 3, True, head_spec, new),
                                                                        head[1])
    return rows


def real_target(kit):
    """``(bf16 copy of the relayed embedded model on the device, tokenizer)`` (fp32 in the dry run: bf16 matmuls
    are slow on CPUs); raises ``RuntimeError`` when the model was not relayed."""
    real = kit.embedded
    if real is None:
        raise RuntimeError("the embedded model was not relayed (bench/README.md): no real-weight drafters")
    dtype = torch.float32 if kit.dry_run else torch.bfloat16
    return copy.deepcopy(real[0]).to(dtype), real[1]


def draft_model(kit, dtype: torch.dtype):
    """The draft model: the relayed embedded model at int4 (the toolkit's torchao path) on CUDA; a copy at
    ``dtype`` on a CPU (the dry run)."""
    model = copy.deepcopy(kit.embedded[0]).to(dtype)
    if kit.device.type == "cuda":
        from toolkit.models.spec import ModelSpec as Spec
        from toolkit.quant.torchao import quantize

        quantize(model, Spec(source="embedded", precision="int4", backend="torchao", torchao_group_size=64),
                 kit.device, "draft")
    return model


def measure_head(kit, head_dir: Path, label: str, stage: str, with_draft: bool = True,
                 prompts_dir: Path | None = None) -> dict:
    """Every row of :func:`_rows` with the head in ``head_dir`` (``label`` names it), on the held-out prompts of
    ``prompts_dir`` (default ``head_dir``); saved under ``stage`` after each row. ``identical_to_ours_ar``: how many
    prompts' tokens equal ours AR's. The dry run: one prompt, 4 tokens, no draft model (a 135M model on a CPU)."""
    from toolkit.eagle.checkpoint import load_head

    target, tok = real_target(kit)
    new = 128 if not kit.dry_run else 4
    prompts = heldout_prompts(prompts_dir or head_dir, 8 if not kit.dry_run else 1)
    with_draft = with_draft and not kit.dry_run
    head = (head_dir, load_head(head_dir, target, dtype=torch.bfloat16 if not kit.dry_run else torch.float32),
            label)
    draft = draft_model(kit, target.dtype) if with_draft else None
    out = {"model": "embedded SmolLM2-135M-Instruct (relayed GGUF)", "dtype": str(target.dtype),
           "prompts": len(prompts), "new_tokens": new, "head": str(head_dir), "rows": {}}
    for name, run in _rows(kit, target, tok, draft, head, new).items():
        if kit.out_of_time(f"{stage or label}: {name}"):
            break
        out["rows"][name] = kit.row(f"{stage or label}: {name}", run, prompts)
        if stage:
            kit.partial(stage, out)
    base = out["rows"].get("ours AR", {}).get("ids")
    for row in out["rows"].values():
        if base and row.get("ids") is not None:
            row["identical_to_ours_ar"] = sum(a == b for a, b in zip(row["ids"], base))
        row.pop("ids", None)
    hf = out["rows"].get("HF static cache + compiled AR", {}).get("tok_s")
    for row in out["rows"].values():
        if hf and row.get("tok_s"):
            row["x_hf_static"] = row["tok_s"] / hf
    return out


def drafters_real(kit) -> dict:
    """:func:`measure_head` with the shipped trained head."""
    return measure_head(kit, SHIPPED, "shipped head, trained on CPU", "drafters_real")
