"""KV-cache compression benchmark on the embedded model (CPU): memory, speed, acceptance and held-out PPL.

    PYTHONPATH=. .venv/bin/python bench/kv_bench.py [--new-tokens 2000] [--repeats 3] [--ppl-tokens 2048]

1. Generation: one chat prompt, ``--new-tokens`` greedy tokens (EOS ignored), the n-gram (prompt-lookup) drafter
   with K = ``--k``, uncompressed vs StreamingLLM (4 sinks + 252 window = budget 256). Runs alternate between the
   two configurations after a warm-up; medians (min-max) over ``--repeats`` runs. Reports exact KV bytes (final
   and peak; sum of cache tensor nbytes), compressions, throughput, acceptance rate and tokens per round.
2. Perplexity of held-out text (GPL-3 license text, not used by calibration), teacher-forced in chunks of K + 1
   tokens through each cache, committing after every chunk — the access pattern of speculative verification:
   none, L2-norm (keep_ratio 0.5), StreamingLLM 4 + 252, head-aware (keep_ratio 0.5: the same bytes as L2).

Writes ``bench/results/kv_bench.json`` and ``bench/results/kv_bench.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.kv import make_policy, ops  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec  # noqa: E402
from toolkit.speculative.adaptive import ConstantK  # noqa: E402
from toolkit.speculative.decoder import SpeculativeDecoder  # noqa: E402
from toolkit.speculative.drafters import NGramDrafter  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402

PROMPT = ("Write a detailed, multi-chapter guide to learning the Python programming language, from installing it "
          "to writing tests, packaging and profiling. Use headings and code examples.")
STREAMING = {"sink_tokens": 4, "window": 252}
PPL_POLICIES = {
    "none": KVSpec("none"),
    "l2norm (keep_ratio 0.5)": KVSpec("l2norm", {"keep_ratio": 0.5}),
    "streaming (4 + 252)": KVSpec("streaming", STREAMING),
    "head_aware (keep_ratio 0.5)": KVSpec("head_aware", {"keep_ratio": 0.5}),
}


def generate_once(model, prompt_ids, kv: KVSpec, new_tokens: int, k: int) -> dict:
    stats = GenerationStats()
    decoder = SpeculativeDecoder(model, NGramDrafter(3, 1), ConstantK(k), make_policy(kv))
    ids = [t for c in decoder.decode(prompt_ids, GenerationSpec(max_new_tokens=new_tokens, ignore_eos=True), stats)
           for t in c]
    assert len(ids) == new_tokens
    return {"throughput": stats.throughput, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_round": stats.tokens_per_round, "kv_bytes_final": stats.kv_bytes_target,
            "kv_bytes_peak": stats.peak_kv_bytes_target, "compressions": stats.compressions_target,
            "total_s": stats.total_ms / 1000}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, kv: KVSpec, chunk: int) -> dict:
    """Teacher-forced NLL of ``ids`` ``(1, n)`` in chunks of ``chunk`` tokens through a cache of policy ``kv``."""
    cache = ops.new_cache(make_policy(kv), model)
    nll, count, n = 0.0, 0, ids.shape[1]
    start_time = time.perf_counter()
    for start in range(0, n - 1, chunk):
        tokens = ids[:, start: min(start + chunk, n - 1)]
        positions = torch.arange(start, start + tokens.shape[1])[None]
        logits = model(input_ids=tokens, past_key_values=cache, use_cache=True,
                       **ops.model_inputs(cache, positions)).logits[0].float()
        targets = ids[0, start + 1: start + 1 + tokens.shape[1]]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
        ops.commit(cache)
    return {"ppl": math.exp(nll / count), "tokens": count, "kv_bytes_final": ops.kv_bytes(cache),
            "compressions": ops.compressions(cache), "seconds": time.perf_counter() - start_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--ppl-text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 avoids oversubscription on a "
                        "busy machine)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(ModelSpec(source="embedded", precision="fp32", device="cpu"))
    result = {"model": "embedded SmolLM2-135M-Instruct fp32", "device": "cpu", "threads": torch.get_num_threads(),
              "drafter": f"ngram (prompt lookup, max_ngram 3), K={args.k}", "new_tokens": args.new_tokens}

    if not args.skip_generation:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                   return_tensors="pt")
        prompt_ids = prompt_ids if torch.is_tensor(prompt_ids) else prompt_ids["input_ids"]
        configs = {"uncompressed": KVSpec("none"), "streaming 4+252": KVSpec("streaming", STREAMING)}
        for kv in configs.values():  # warm-up
            generate_once(model, prompt_ids, kv, 32, args.k)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for rep in range(args.repeats):
            for name, kv in configs.items():
                runs[name].append(generate_once(model, prompt_ids, kv, args.new_tokens, args.k))
                print(f"[gen] {name} run {rep}: {runs[name][-1]}", flush=True)
        gen = {name: summarize(r) for name, r in runs.items()}
        base, comp = gen["uncompressed"], gen["streaming 4+252"]
        gen["ratios (streaming / uncompressed)"] = {
            key: comp[key]["median"] / base[key]["median"]
            for key in ("throughput", "acceptance_rate", "tokens_per_round", "kv_bytes_final", "kv_bytes_peak")}
        result["prompt_tokens"] = prompt_ids.shape[1]
        result["generation"] = gen

    text = Path(args.ppl_text).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.ppl_tokens]
    result["ppl_text"] = f"{args.ppl_text}, first {ids.shape[1]} tokens, chunks of K+1={args.k + 1}"
    result["perplexity"] = {}
    for name, kv in PPL_POLICIES.items():
        result["perplexity"][name] = perplexity(model, ids, kv, args.k + 1)
        print(f"[ppl] {name}: {result['perplexity'][name]}", flush=True)

    out = Path(args.out)
    atomic_write_json(out / "kv_bench.json", result)
    atomic_write_text(out / "kv_bench.md", markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# KV compression benchmark — {result['model']}, {result['device']} ({result['threads']} threads)", ""]
    if "generation" in result:
        gen = result["generation"]
        lines += [f"Generation: {result['new_tokens']} new tokens after a {result['prompt_tokens']}-token prompt, "
                  f"greedy, drafter {result['drafter']}; median (min-max) of the runs.", "",
                  "| cache | throughput (tok/s) | acceptance | tokens/round | KV bytes final | KV bytes peak | "
                  "compressions |", "|---|---|---|---|---|---|---|"]
        for name in ("uncompressed", "streaming 4+252"):
            g = gen[name]

            def fmt(key, spec=".2f"):
                return f"{g[key]['median']:{spec}} ({g[key]['min']:{spec}}-{g[key]['max']:{spec}})"
            lines.append(f"| {name} | {fmt('throughput')} | {fmt('acceptance_rate', '.3f')} | "
                         f"{fmt('tokens_per_round')} | {g['kv_bytes_final']['median']:,.0f} | "
                         f"{g['kv_bytes_peak']['median']:,.0f} | {g['compressions']['median']:.0f} |")
        r = gen["ratios (streaming / uncompressed)"]
        lines += ["", "Streaming / uncompressed: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), ""]
    lines += [f"Perplexity: {result['ppl_text']}.", "", "| policy | PPL | KV bytes at end | compressions |",
              "|---|---|---|---|"]
    for name, p in result["perplexity"].items():
        lines.append(f"| {name} | {p['ppl']:.3f} | {p['kv_bytes_final']:,} | {p['compressions']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
