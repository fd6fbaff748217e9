"""Quantized KV cache benchmark on the embedded model (CPU), in one run: ours (KIVI, :mod:`toolkit.kv.quantized`) vs
HF ``QuantizedCache`` (optimum-quanto and HQQ backends) vs eviction at equal bytes, plus QuantSpec-style
self-speculation.

    PYTHONPATH=. .venv/bin/python bench/kv_quant_bench.py [--ppl-tokens 4096] [--texts prose,code] [--threads 1]

1. **Perplexity** of held-out text (:func:`eval.data.heldout_ids`, prose and code) through each cache with the
   evaluator's protocol (:func:`eval.metrics.perplexity_through_cache`: chunks of K + 1 = 5 tokens, commit after
   each), fp32 model: uncompressed; ours 8/4/2-bit; HF quanto 4/2-bit; HF HQQ 4/2-bit (same bits, group 64,
   residual 128); StreamingLLM and L2 at the peak bytes of our 4-bit cache.
2. **Exact bytes at 4096 tokens**: a bf16 model prefills 4096 tokens into each cache, one commit, ``kv_bytes``
   (packed codes + scales + zero points + residual, or the backend's tensors) vs the bf16 ``DynamicCache``.
3. **Decode speed** through ``model.generate(past_key_values=cache)`` (same loop for every cache): median of
   ``--repeats`` runs of ``--new-tokens`` greedy tokens after a ``--prompt-tokens`` prompt; prefill excluded; the
   caches interleaved and rotated by :func:`toolkit.measure.harness.measure`.
4. **Rollback**: rounds of (5 wrong draft tokens, ``crop(-5)``, the true token) vs a cache that only saw the true
   tokens: the first round where next-token logits differ, for each cache; and speculative (n-gram drafter, K = 4)
   vs AR greedy output with each cache as the target cache: the first diverging token.
5. **QuantSpec-style self-speculation** (Tiwari et al. 2025): the draft is the target's own weights at low precision
   (NF4 / bf16) reading a 4-bit KV cache; throughput vs AR in the same run (interleaved by the harness).

Writes ``bench/results/kv_quant_bench.json`` and ``bench/results/kv_quant_bench.md``. Timings on a shared 2-core
CPU are noisy; ratios measured in one run are what to compare.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.data import heldout_ids  # noqa: E402
from eval.metrics import perplexity_through_cache  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.kv import make_policy  # noqa: E402
from toolkit.kv.contract import new_cache  # noqa: E402
from toolkit.measure.harness import Call, Prompt, measure  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec  # noqa: E402
from toolkit.engine.planner import ConstantK  # noqa: E402
from toolkit.engine.decoder import SpeculativeDecoder  # noqa: E402
from toolkit.speculative.drafters import DraftModel, NGramDrafter  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402

GROUP, RESIDUAL, K = 64, 128, 4
HF_AXES = {"quanto": 0, "hqq": 1}  # HF's documented axis for each backend (axis_key = axis_value)


# ------------------------------------------------------------------------------------------------ HF caches
def hf_cache_class():
    from transformers import QuantizedCache

    class HFQuantizedCacheBytes(QuantizedCache):
        """HF ``QuantizedCache`` through the toolkit's cache contract (:mod:`toolkit.kv.contract`): exact
        ``kv_bytes`` (the backend's packed data, scales and zero points + the full-precision residual); HF
        quantizes whenever its residual fills, so a commit point has nothing to do."""

        compressions = 0

        def commit(self) -> None:
            pass

        def forward_kwargs(self, position_ids) -> dict:
            return {"position_ids": position_ids}

        def kv_bytes(self) -> int:
            total = 0
            for layer in self.layers:
                if not layer.is_initialized:
                    continue
                total += layer.keys.nbytes + layer.values.nbytes
                for q in (layer._quantized_keys, layer._quantized_values):
                    total += hf_quantized_nbytes(q)
            return total

    return HFQuantizedCacheBytes


def hf_quantized_nbytes(q) -> int:
    if q is None:
        return 0
    if isinstance(q, tuple):  # HQQ: (packed uint8, meta with scale / zero)
        data, meta = q
        return data.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
    packed = q._data  # optimum-quanto WeightQBitsTensor: PackedTensor (its own uint8 storage) + scale + shift
    storage = getattr(packed, "_data", packed)
    return storage.nbytes + q._scale.nbytes + q._shift.nbytes


class HFPolicy:
    """Adapter so HF's cache goes through the same code paths (``new_cache``, the decoder) as ours."""

    def __init__(self, backend: str, bits: int):
        self.backend, self.bits, self.name = backend, bits, f"hf-{backend}"

    def make_cache(self, model):
        axis = HF_AXES[self.backend]
        return hf_cache_class()(self.backend, model.config, nbits=self.bits, axis_key=axis, axis_value=axis,
                                q_group_size=GROUP, residual_length=RESIDUAL)

    def describe(self) -> dict:
        return {"policy": self.name, "nbits": self.bits, "q_group_size": GROUP, "residual_length": RESIDUAL,
                "axis_key": HF_AXES[self.backend], "axis_value": HF_AXES[self.backend]}


def ours(bits: int, **extra) -> KVSpec:
    return KVSpec("quantized", {"quant_bits": bits, "quant_group_size": GROUP, "residual_length": RESIDUAL, **extra})


def caches(eight_bit: bool = False) -> dict:
    """name -> a factory of a policy (``None`` = uncompressed) for every quantized cache compared (ours at 8 bits
    only where asked: HF's quanto backend has no 8-bit KV)."""
    out = {"none (fp)": lambda: None}
    for bits in ((8, 4, 2) if eight_bit else (4, 2)):
        out[f"ours {bits}-bit"] = lambda b=bits: make_policy(ours(b))
    out["ours 2-bit, no sinks (plain KIVI)"] = lambda: make_policy(ours(2, sink_tokens=0))
    for backend in ("quanto", "hqq"):
        for bits in (4, 2):
            out[f"HF {backend} {bits}-bit"] = lambda be=backend, b=bits: HFPolicy(be, b)
    if ONLY:
        out = {name: f for name, f in out.items() if name == "none (fp)" or any(o in name for o in ONLY)}
    return out


ONLY: list[str] = []  # --only: substrings of the cache names to run (the uncompressed baseline always runs)


def attempt(fn, errors: dict, name: str):
    try:
        return fn()
    except Exception as exc:  # a backend that does not run here: record why
        errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc()
        return None


# ------------------------------------------------------------------------------------------------ 1. perplexity
def perplexity_section(model, tokenizer, texts, num_tokens, errors) -> dict:
    out = {}
    for source in texts:
        ids = heldout_ids(tokenizer, source, num_tokens)
        rows = {}
        for name, factory in caches().items():
            t0 = time.perf_counter()
            r = attempt(lambda f=factory: perplexity_through_cache(model, ids, f(), chunk=K + 1), errors,
                        f"ppl/{source}/{name}")
            if r is not None:
                rows[name] = {"ppl": r["value"], "peak_kv_bytes": r["peak_kv_bytes"],
                              "seconds": time.perf_counter() - t0}
                print(f"[ppl {source}] {name}: {rows[name]}", flush=True)
        config = model.config
        per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # fp32
        if "ours 4-bit" in rows:
            budget = rows["ours 4-bit"]["peak_kv_bytes"] // per_token
            evictions = {
                f"streaming 4+{budget - 12} (= ours 4-bit bytes)":
                    KVSpec("streaming", {"sink_tokens": 4, "window": budget - 12, "compress_interval": 8}),
                f"l2norm budget {budget - 8}, all layers (= ours 4-bit bytes)":
                    KVSpec("l2norm", {"budget": budget - 8, "skip_layers": [], "compress_interval": 8}),
            }
            for name, spec in evictions.items():
                if ONLY and not any(o in name for o in ONLY):
                    continue
                r = perplexity_through_cache(model, ids, make_policy(spec), chunk=K + 1)
                rows[name] = {"ppl": r["value"], "peak_kv_bytes": r["peak_kv_bytes"]}
                print(f"[ppl {source}] {name}: {rows[name]}", flush=True)
        base = rows["none (fp)"]["ppl"]
        for row in rows.values():
            row["ppl_ratio"] = row["ppl"] / base
        out[source] = {"tokens": len(ids), "rows": rows}
    return out


# ------------------------------------------------------------------------------------------------ 2. bytes
@torch.no_grad()
def bytes_section(tokenizer, num_tokens, errors) -> dict:
    model, _ = load_model(ModelSpec(source="embedded", precision="bf16", device="cpu"))
    ids = torch.tensor([heldout_ids(tokenizer, "prose", num_tokens)])
    rows = {}
    for name, factory in caches(eight_bit=True).items():
        def nbytes(f=factory, m=model):
            cache = new_cache(f(), m)
            m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.commit()
            return cache.kv_bytes()

        value = attempt(nbytes, errors, f"bytes/{name}")
        if value is not None:
            rows[name] = value
    base = rows["none (fp)"]
    del model
    return {"tokens": num_tokens, "model_dtype": "bf16",
            "rows": {name: {"kv_bytes": b, "ratio_vs_bf16": b / base} for name, b in rows.items()}}


# ------------------------------------------------------------------------------------------------ 3. decode speed
@torch.no_grad()
def speed_section(model, tokenizer, prompt_tokens, new_tokens, repeats, errors) -> dict:
    prompt = torch.tensor([heldout_ids(tokenizer, "prose", prompt_tokens)])

    def timed(factory, n):
        policy = factory()
        cache = policy.make_cache(model) if policy is not None else None
        kwargs = {"past_key_values": cache} if cache is not None else {}
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
        return time.perf_counter() - t0

    def runner(factory):
        def run(_ids, _gen) -> Call:  # decode only: the prefill (a 1-token generate) is subtracted
            prefill = timed(factory, 1)
            total = timed(factory, new_tokens)
            return Call([], GenerationStats(new_tokens=new_tokens - 1, total_ms=max(total - prefill, 1e-9) * 1000))
        return run

    # a cache that fails (an HF backend that crashes here) is recorded in errors and left out of the timing
    working = {name: f for name, f in caches().items() if attempt(lambda f=f: timed(f, 4), errors, f"speed/{name}")}
    m = measure({name: runner(f) for name, f in working.items()}, [Prompt("prose", "prose", prompt)],
                GenerationSpec(max_new_tokens=new_tokens), repeats=repeats, warmup=0, rotate=True, desc="speed")
    rows = {}
    for name in working:
        t = m.speed(name)["throughput"]
        rows[name] = {"decode_tok_s": t["median"], "min": t["min"], "max": t["max"]}
        print(f"[speed] {name}: {rows[name]}", flush=True)
    base = rows["none (fp)"]["decode_tok_s"]
    for row in rows.values():
        row["vs_fp"] = row["decode_tok_s"] / base
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "rows": rows}


# ------------------------------------------------------------------------------------------------ 4. rollback
@torch.no_grad()
def rollback_section(model, tokenizer, rounds, errors) -> dict:
    ids = heldout_ids(tokenizer, "code", 600)
    start = 200
    out = {}
    for name, factory in caches().items():
        if name == "none (fp)":
            continue

        def probe(f=factory):
            seen, clean = new_cache(f(), model), new_cache(f(), model)
            prefix = torch.tensor([ids[:start]])
            for cache in (seen, clean):
                model(input_ids=prefix, past_key_values=cache, **cache.forward_kwargs(torch.arange(start)[None]))
                cache.commit()
            first_bad, max_diff, length_ok = None, 0.0, True
            for r in range(rounds):
                pos = start + r
                wrong = torch.tensor([[(ids[pos] + 1 + j) % 49152 for j in range(K + 1)]])
                model(input_ids=wrong, past_key_values=seen,
                      **seen.forward_kwargs(torch.arange(pos, pos + K + 1)[None]))
                seen.crop(-(K + 1))
                length_ok &= seen.get_seq_length() == pos
                true = torch.tensor([[ids[pos]]])
                logits = []
                for cache in (seen, clean):
                    o = model(input_ids=true, past_key_values=cache,
                              **cache.forward_kwargs(torch.tensor([[pos]])))
                    cache.commit()
                    logits.append(o.logits[0, -1])
                diff = float((logits[0] - logits[1]).abs().max())
                max_diff = max(max_diff, diff)
                if diff > 1e-4 and first_bad is None:
                    first_bad = r
            return {"rounds": rounds, "first_diverging_round": first_bad, "max_abs_logit_diff": max_diff,
                    "length_right_after_every_crop": bool(length_ok)}

        def spec_vs_ar(f=factory):
            prompt = torch.tensor([ids[:start]])
            outs = []
            for drafter in (None, NGramDrafter(3, 1)):
                decoder = SpeculativeDecoder(model, drafter, ConstantK(K), f())
                outs.append([t for c in decoder.decode(prompt, GenerationSpec(max_new_tokens=rounds, ignore_eos=True),
                                                       GenerationStats()) for t in c])
            ar, spec = outs
            first = next((i for i, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
            return {"new_tokens": rounds, "identical": ar == spec, "first_diverging_token": first}

        row = {"crop_probe": attempt(probe, errors, f"rollback/{name}"),
               "speculative_vs_ar": attempt(spec_vs_ar, errors, f"rollback-spec/{name}")}
        out[name] = row
        print(f"[rollback] {name}: {row}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------ 5. QuantSpec
@torch.no_grad()
def selfspec_section(model, tokenizer, prompt_tokens, new_tokens, repeats, errors) -> dict:
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    prompt = torch.tensor([heldout_ids(tokenizer, "prose", prompt_tokens)])
    drafts = {"int4": load_model(ModelSpec(source="embedded", precision="int4", device="cpu"))[0],
              "bf16": load_model(ModelSpec(source="embedded", precision="bf16", device="cpu"))[0]}
    kv4 = ours(4)
    configs = {
        "AR fp32, fp cache": (None, None, None),
        "AR fp32, 4-bit cache": (None, None, kv4),
        "self-spec int4 draft, fp draft cache": ("int4", None, None),
        "self-spec int4 draft, 4-bit draft cache (QuantSpec)": ("int4", kv4, None),
        "self-spec int4 draft + 4-bit caches for both": ("int4", kv4, kv4),
        "self-spec bf16 draft, 4-bit draft cache": ("bf16", kv4, None),
    }

    def once(cfg, n):
        draft, draft_kv, target_kv = cfg
        drafter = None if draft is None else DraftModel(drafts[draft], make_policy(draft_kv) if draft_kv else None)
        stats = GenerationStats()
        decoder = SpeculativeDecoder(model, drafter, ConstantK(K), make_policy(target_kv) if target_kv else None)
        t0 = time.perf_counter()
        ids = [t for c in decoder.decode(prompt, GenerationSpec(max_new_tokens=n, ignore_eos=True), stats) for t in c]
        stats.new_tokens, stats.total_ms = len(ids), (time.perf_counter() - t0) * 1000
        return Call(ids, stats)

    # warm-up call per configuration; one that fails is recorded in errors and left out of the timing
    working = {name: c for name, c in configs.items() if attempt(lambda c=c: once(c, 4), errors, f"selfspec/{name}")}
    m = measure({name: (lambda _ids, _gen, c=c: once(c, new_tokens)) for name, c in working.items()},
                [Prompt("prose", "prose", prompt)], GenerationSpec(max_new_tokens=new_tokens), repeats=repeats,
                warmup=0, rotate=True, desc="self-speculation")
    rows, reference = {}, {}
    for name in working:
        t, stats = m.speed(name)["throughput"], m.first(name)[0].stats
        rows[name] = {"tok_s": t["median"], "min": t["min"], "max": t["max"],
                      "acceptance_rate": stats.acceptance_rate, "tokens_per_round": stats.tokens_per_round,
                      "kv_bytes_target": stats.kv_bytes_target, "kv_bytes_draft": stats.kv_bytes_draft}
        reference[name] = m.first(name)[0].token_ids
        print(f"[selfspec] {name}: {rows[name]}", flush=True)
    base = rows.get("AR fp32, fp cache", {}).get("tok_s")
    for name, row in rows.items():
        row["vs_ar"] = row["tok_s"] / base if base else None
        ar_ref = reference.get("AR fp32, 4-bit cache" if configs[name][2] else "AR fp32, fp cache")
        row["greedy_equal_to_ar_same_target_cache"] = reference[name] == ar_ref if ar_ref else None
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "k": K, "repeats": repeats, "rows": rows}


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--bytes-tokens", type=int, default=4096)
    parser.add_argument("--rollback-rounds", type=int, default=200, help="HF flushes its residual (128) into the "
                        "quantized part only after ~124 rounds: fewer rounds cannot show its crop bug")
    parser.add_argument("--texts", default="prose,code")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="bytes,ppl,speed,rollback,selfspec")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of cache names to run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ONLY.extend(o for o in args.only.split(",") if o)
    torch.manual_seed(0)
    sections = args.sections.split(",")
    model, tokenizer = load_model(ModelSpec(source="embedded", precision="fp32", device="cpu"))
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "optimum-quanto", "hqq"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    result = {"model": "embedded SmolLM2-135M-Instruct", "device": "cpu", "threads": torch.get_num_threads(),
              "versions": versions, "group": GROUP, "residual": RESIDUAL, "k": K, "errors": {},
              "note": "timings on a shared 2-core CPU: noisy; compare ratios within this run"}
    errors = result["errors"]
    out = Path(args.out)

    def save() -> None:  # after every section, so a long run that is stopped keeps what it measured
        atomic_write_json(out / "kv_quant_bench.json", result)
        atomic_write_text(out / "kv_quant_bench.md", markdown(result))

    if "bytes" in sections:
        result["bytes"] = bytes_section(tokenizer, args.bytes_tokens, errors)
        save()
    if "ppl" in sections:
        result["perplexity"] = {}
        for source in args.texts.split(","):
            result["perplexity"].update(perplexity_section(model, tokenizer, [source], args.ppl_tokens, errors))
            save()
    if "rollback" in sections:
        result["rollback"] = rollback_section(model, tokenizer, args.rollback_rounds, errors)
        save()
    if "speed" in sections:
        result["speed"] = speed_section(model, tokenizer, args.prompt_tokens, args.new_tokens, args.repeats, errors)
        save()
    if "selfspec" in sections:
        result["self_speculation"] = selfspec_section(model, tokenizer, args.prompt_tokens, args.new_tokens,
                                                      max(1, args.repeats - 1), errors)
        save()
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# Quantized KV cache benchmark — {r['model']}, {r['device']} ({r['threads']} threads)", "",
             f"Group {r['group']}, residual {r['residual']}, K = {r['k']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f". {r['note']}.", ""]
    if "bytes" in r:
        b = r["bytes"]
        lines += [f"## Exact KV bytes after {b['tokens']} tokens ({b['model_dtype']} model, one prefill + commit)",
                  "", "| cache | KV bytes | vs bf16 cache |", "|---|---|---|"]
        lines += [f"| {n} | {v['kv_bytes']:,} | {v['ratio_vs_bf16']:.1%} |" for n, v in b["rows"].items()]
        lines.append("")
    for source, p in r.get("perplexity", {}).items():
        lines += [f"## Perplexity through the cache — {source}, {p['tokens']} held-out tokens, fp32 model, "
                  f"chunks of K+1, commit after each", "", "| cache | PPL | vs fp | peak KV bytes (fp32 model) |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {v['ppl']:.3f} | {v['ppl_ratio'] - 1:+.2%} | {v['peak_kv_bytes']:,} |"
                  for n, v in p["rows"].items()]
        lines.append("")
    if "speed" in r:
        s = r["speed"]
        lines += [f"## Decode speed, model.generate, {s['prompt_tokens']}-token prompt, {s['new_tokens']} new tokens "
                  f"(median of {s['repeats']}, prefill excluded; noisy)", "",
                  "| cache | tok/s | min-max | vs fp |", "|---|---|---|---|"]
        lines += [f"| {n} | {v['decode_tok_s']:.2f} | {v['min']:.2f}-{v['max']:.2f} | {v['vs_fp']:.2f}x |"
                  for n, v in s["rows"].items()]
        lines.append("")
    if "rollback" in r:
        lines += ["## Rollback: (K+1 wrong tokens, crop(-(K+1)), true token) rounds vs a clean cache; "
                  "speculative (n-gram, K=4) vs AR greedy with the same cache", "",
                  "| cache | first diverging round | max abs logit diff | length right after crop | "
                  "spec == AR | first diverging token |", "|---|---|---|---|---|---|"]
        for n, v in r["rollback"].items():
            c, s = v["crop_probe"] or {}, v["speculative_vs_ar"] or {}
            lines.append(f"| {n} | {c.get('first_diverging_round')} of {c.get('rounds')} | "
                         f"{c.get('max_abs_logit_diff', float('nan')):.3g} | {c.get('length_right_after_every_crop')}"
                         f" | {s.get('identical')} | {s.get('first_diverging_token')} |")
        lines.append("")
    if "self_speculation" in r:
        s = r["self_speculation"]
        lines += [f"## QuantSpec-style self-speculation: {s['prompt_tokens']}-token prompt, {s['new_tokens']} new "
                  f"tokens, K = {s['k']} (median of {s['repeats']}; noisy)", "",
                  "| config | tok/s | vs AR | acceptance | tokens/round | target KV bytes | draft KV bytes | "
                  "greedy == AR |", "|---|---|---|---|---|---|---|---|"]
        for n, v in s["rows"].items():
            lines.append(f"| {n} | {v['tok_s']:.2f} | {v['vs_ar']:.2f}x | {v['acceptance_rate']:.3f} | "
                         f"{v['tokens_per_round']:.2f} | {v['kv_bytes_target']:,} | {v['kv_bytes_draft']:,} | "
                         f"{v['greedy_equal_to_ar_same_target_cache']} |")
        lines.append("")
    if r["errors"]:
        lines += ["## Did not run", ""] + [f"- {k}: {v}" for k, v in r["errors"].items()] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
