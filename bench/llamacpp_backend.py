"""Ours on llama.cpp (``target.backend: llama.cpp``, the main recipe's drafter and planner) against llama.cpp's own
AR and llama.cpp's own prompt-lookup decoding, on the same GGUF file, in one process.

    make bench-llamacpp-backend       # builds / installs the [llamacpp] extra first (make llamacpp)
    PYTHONPATH=. .venv/bin/python bench/llamacpp_backend.py [--recipe short] [--suites short-heldout unseen ...]
        [--num-prompts N] [--max-new-tokens 96] [--repeats 3] [--threads 2] [--gguf FILE | --requantize Q4_K_M]
        [--kv q8_0] [--plain] [--eagle [--eagle-k 3]]
        [--out bench/reports/llamacpp-backend]
    make bench-llamacpp-gemma3        # a second family: Gemma 3 270M's Q4_K_M file from PyPI, --plain

Methods, each on the same prompt token ids (the recipe's chat template), greedy, the same EOS ids and
``max_new_tokens``, ``--threads`` threads each:

* ``ours`` — the recipe with its target on llama.cpp (:func:`eval.runners.llamacpp_variant`): our decoder, the
  recipe's drafter (lookup with memory across the requests of one repetition) and cost-aware verify length, the
  verify cost curve measured through llama.cpp (cached per machine);
* ``llamacpp_ar`` — ``Llama.generate`` with temperature 0 (argmax), a context of its own, reset before each request;
* ``llamacpp_lookup`` — the same with llama.cpp's Python prompt-lookup drafter (``LlamaPromptLookupDecoding``,
  ``--lookup-tokens`` per draft, n-gram ``--max-ngram``);
* ``ours_eagle`` (with ``--eagle``) — the same target on llama.cpp with the shipped EAGLE-1 head drafting from
  llama.cpp's embeddings output (bf16 head on torch, up to ``--eagle-k`` tokens, the recipe's verify-length rule).

Protocol (:func:`toolkit.measure.harness.measure`): ours' ``warm_up`` (the widest verify once: llama.cpp's first
forward with more output rows than before costs ~2x), one warm-up call per method, then ``--repeats`` repetitions,
methods interleaved per prompt with the order rotated between repetitions, the drafter's memory cleared before each
repetition; tok/s = new tokens / wall time of the call, prompt included (TTFT counted); medians over repetitions.
Greedy identity: ours' tokens against llama.cpp AR's, per prompt.

``--gguf`` runs another GGUF file as the target (the recipe's drafter and generation settings kept): the verify cost
depends on the file's block types (ggml repacks Q4_0 / Q4_K / IQ4_NL blocks for batched matmuls on x86; Q4_1 has no
such path, so a 4-token verify costs ~2.5x a 1-token step on Q4_1 and ~1.5x on Q4_0 / Q4_K_M). ``--requantize TYPE``
runs the recipe's GGUF re-quantized to ``TYPE`` by llama.cpp's own quantizer (``llama_model_quantize``, written once
into the toolkit's cache): a stand-in for a file of that type where no other is at hand offline.

``--plain`` gives every prompt as plain text (a chat prompt's message contents, each followed by a blank line:
:func:`toolkit.measure.prompts.plain_text`), for a base model's file whose tokenizer has no chat template (Gemma 3
270M's, ``scripts/gemma3_gguf.py``); every method reads the same token ids.

Before the suites, the report's perplexity line compares our evaluator's perplexity through llama.cpp's logits with
llama.cpp's own (``Llama.eval`` with ``logits_all``) on the same 512 tokens of Python's LICENSE
(:func:`perplexity_pair`).

Every context, ours and llama.cpp's, runs flash attention (``toolkit.models.llamacpp.cache_kwargs``; llama.cpp's own
CPU default). ``--kv q8_0`` runs every method on a q8_0 KV cache (keys and values: ours through ``kv.policy:
ggml_types``, llama.cpp's through ``type_k`` / ``type_v``). There a verify forward's logits equal one-token steps'
bit for bit on Q4_1 / Q4_0 / Q8_0 files at any length (``bench/llamacpp_width.py``), so ours equals llama.cpp's
greedy AR token for token; on the default f16 cache they do up to 256 cached positions, and past them batched
attention differs from the one-token path by up to ~2 in a logit, so greedy texts can part where the top-2 margin is
smaller.

Writes ``<out>/llamacpp_backend.json`` and ``<out>/README.md`` with ``lscpu``'s model name and AVX flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.runners import llamacpp_variant, ours_runner  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Call, Prompt, environment, measure, spread  # noqa: E402
from toolkit.measure.prompts import load_suite, plain_text  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.recipe.sections import KVSpec  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

SUITES = {"short-heldout": "short-heldout", "unseen": str(ROOT / "bench/prompts/unseen.yaml"), "short": "short",
          "repeat": "repeat"}
COLUMNS = {"ours": "ours on llama.cpp", "llamacpp_ar": "llama.cpp AR", "llamacpp_lookup": "llama.cpp prompt lookup",
           "ours_eagle": "ours on llama.cpp, EAGLE head"}
FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def requantized(source: str, ftype: str) -> Path:
    """``source``'s GGUF re-quantized to ``ftype`` by llama.cpp's quantizer, written once into the toolkit's cache
    (to a temporary name, then renamed: never a half-written file)."""
    import ctypes
    import os

    import llama_cpp

    from toolkit.models.embedded import gguf_source
    from toolkit.resources import cache_dir

    path, name = gguf_source(source, "--recipe target.source")
    out = cache_dir() / f"{name}.{ftype}.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = getattr(llama_cpp, FTYPES[ftype]), True
        partial = out.with_suffix(f".{os.getpid()}.partial")
        if llama_cpp.llama_model_quantize(str(path).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            partial.unlink(missing_ok=True)
            sys.exit(f"--requantize {ftype}: llama.cpp could not quantize {path}")
        partial.replace(out)
    return out


def llamacpp_runner(path: str, threads: int, eos: set[int], lookup_tokens: int = 0, max_ngram: int = 3,
                    kv: str = "f16"):
    """llama.cpp's own greedy decoding (``Llama.generate``, temperature 0), optionally with its prompt lookup, on a
    ``kv`` cache (``f16``; ``q8_0``: keys and values, with flash attention), as our context's (``cache_kwargs``)."""
    from llama_cpp import Llama

    from toolkit.models.llamacpp import cache_kwargs

    draft = None
    if lookup_tokens:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=lookup_tokens)
    # logits_all with a draft: llama-cpp-python's draft path overflows its n_batch-row scores past 512 prompt tokens
    llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                logits_all=draft is not None, verbose=False, **cache_kwargs(kv, kv))

    def run(input_ids: torch.Tensor, gen) -> Call:
        llm.reset()
        out: list[int] = []
        stats = GenerationStats()
        start = time.perf_counter()
        first = None
        for token in llm.generate(input_ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            out.append(int(token))
            if int(token) in eos or len(out) >= gen.max_new_tokens:
                break
        end = time.perf_counter()
        stats.new_tokens, stats.prompt_tokens = len(out), int(input_ids.shape[1])
        stats.ttft_ms, stats.total_ms = ((first or end) - start) * 1000, (end - start) * 1000
        stats.rounds = stats.target_forwards = max(len(out) - 1, 0)
        return Call(out, stats)

    return run


#: the text both perplexities are taken on: the first 120 lines of Python's own LICENSE (every install has it)
PPL_SOURCE = {"files": ["stdlib:LICENSE.txt"], "start_line": 1, "num_lines": 120}


def perplexity_pair(ours) -> dict:
    """Perplexity of :data:`PPL_SOURCE`'s first :data:`~toolkit.models.llamacpp.N_BATCH` tokens on the target's file
    two ways: through our evaluator (:func:`eval.metrics.perplexity_sliding_window`, one window: llama.cpp's logits
    at every position, f16 cache) and through llama.cpp's own ``Llama.eval`` with ``logits_all`` (its scores,
    through the evaluator's :func:`~eval.metrics.nll_sum`): the same token ids, context size, batch, cache and
    threads."""
    import math

    from llama_cpp import Llama

    from eval.metrics import nll_sum, perplexity_sliding_window
    from toolkit.measure.prompts import read_passage
    from toolkit.models.llamacpp import N_BATCH, cache_kwargs

    target = ours.target
    ids = ours.tokenizer(read_passage(PPL_SOURCE, "PPL_SOURCE")).input_ids[:N_BATCH]
    llm = Llama(model_path=str(target.gguf_path), n_ctx=target.n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
                n_threads=target.threads, n_threads_batch=target.threads, logits_all=True, verbose=False,
                **cache_kwargs())
    llm.eval(ids)
    nll = nll_sum(torch.from_numpy(llm.scores[: len(ids) - 1]), torch.tensor(ids[1:]))
    llm.close()
    whole = perplexity_sliding_window(target, ids, window=len(ids), stride=len(ids))
    return {"tokens": len(ids), "ours": whole["value"], "llama_cpp": math.exp(nll / (len(ids) - 1)),
            "nll_sum_ours": whole["nll_sum"], "nll_sum_llama_cpp": nll}


def suite_result(measured, methods: list[str]) -> dict:
    """Per prompt and overall: median tok/s per method, ours' ratios, τ, greedy identity with llama.cpp AR; per prompt
    also each method's new tokens and TPOT (ms a token after the first): where the texts part at a near-tie and stop
    at different lengths, tok/s (prompt included) spreads the prefill over different counts, and TPOT tells the decode
    speeds apart."""
    rows = []
    for i, prompt in enumerate(measured.prompts):
        row = {"prompt": prompt.id, "kind": prompt.kind, "new_tokens": {}, "tpot_ms": {}}
        for m in methods:
            calls = measured.per_prompt(m, i)
            row[m] = statistics.median(c.stats.throughput for c in calls)
            row["new_tokens"][m] = calls[-1].stats.new_tokens
            row["tpot_ms"][m] = statistics.median(c.stats.tpot_ms for c in calls)
        ours = measured.per_prompt("ours", i)[-1]
        row["tau"] = ours.stats.tokens_per_round
        row["identical_to_llamacpp_ar"] = ours.token_ids == measured.per_prompt("llamacpp_ar", i)[-1].token_ids
        rows.append(row)
    overall = {m: measured.speed(m)["throughput"]["median"] for m in methods}
    ratios = {f"ours_vs_{m}": measured.paired_ratio("ours", m) for m in methods if m != "ours"}
    taus = {m: measured.tau(m) for m in methods if m.startswith("ours")}
    return {"rows": rows, "overall": overall, "ratios": ratios, "tau": taus["ours"], "taus": taus}


def markdown(report: dict) -> str:
    c = report["cpu"]
    lines = ["# Ours on llama.cpp vs llama.cpp AR vs llama.cpp prompt lookup", "",
             f"CPU: {cpu_line(c)}.",
             f"llama-cpp-python {report['llama_cpp']}, {report['threads']} thread(s), GGUF {report['gguf']}, "
             f"{report.get('kv', 'f16')} KV cache; recipe {report['recipe']} on llama.cpp; "
             f"{report['max_new_tokens']} new tokens, median of {report['repeats']} "
             "interleaved repetitions, tok/s including the prompt (where the texts part and stop at different lengths, "
             "the new tokens and TPOT columns tell the decode speeds apart)"
             + ("; prompts as plain text (a base model: chat messages' contents, no chat template)."
                if report.get("plain") else "."), "",
             f"Verify cost curve through llama.cpp (ms for 1..16 tokens): {report['verify_ms']}", ""]
    ppl = report.get("perplexity")  # absent in reports before 2026-12-07
    if ppl:
        same = "equal" if ppl["nll_sum_ours"] == ppl["nll_sum_llama_cpp"] else "NOT equal"
        lines += [f"Perplexity on {ppl['tokens']} tokens of Python's LICENSE (f16 cache): ours (our evaluator on "
                  f"llama.cpp's logits) {ppl['ours']:.4f}, llama.cpp's own (`Llama.eval`, logits_all) "
                  f"{ppl['llama_cpp']:.4f}: "
                  f"summed NLL {same} bit for bit.", ""]
    for suite, result in report["suites"].items():
        methods = list(result["overall"])
        lines += [f"## {suite}", "", "| prompt | " + " | ".join(COLUMNS[m] for m in methods) +
                  " | ours / AR | ours / PL | τ | = llama.cpp AR | new tokens ours / AR | TPOT ms ours / AR |",
                  "|---" * (len(methods) + 7) + "|"]
        for row in result["rows"]:
            tokens, tpot = row.get("new_tokens", {}), row.get("tpot_ms", {})  # absent in reports before 2026-11-28
            lines.append(f"| {row['prompt']} | " + " | ".join(f"{row[m]:.1f}" for m in methods) +
                         f" | {row['ours'] / row['llamacpp_ar']:.2f}x | {row['ours'] / row['llamacpp_lookup']:.2f}x"
                         f" | {row['tau']:.2f} | {'yes' if row['identical_to_llamacpp_ar'] else 'NO'} | "
                         + (f"{tokens['ours']} / {tokens['llamacpp_ar']} | {tpot['ours']:.1f} / "
                            f"{tpot['llamacpp_ar']:.1f} |" if tokens else "- | - |"))
        r = result["ratios"]
        lines += ["| all | " + " | ".join(f"{result['overall'][m]:.1f}" for m in methods) +
                  f" | {r['ours_vs_llamacpp_ar']:.2f}x | {r['ours_vs_llamacpp_lookup']:.2f}x | {result['tau']:.2f} "
                  "| | | |", ""]
        if "ours_eagle" in methods:
            eagle = result["overall"]["ours_eagle"] / result["overall"]["llamacpp_ar"]
            tau = result["taus"]["ours_eagle"]
            lines += [f"EAGLE head on llama.cpp: {eagle:.2f}x llama.cpp AR (medians), τ {tau:.2f}; ours (lookup) / "
                      f"ours EAGLE {r['ours_vs_ours_eagle']:.2f}x.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="short")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per suite (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--gguf", type=Path, default=None, help="the target's GGUF file (default: the recipe's)")
    parser.add_argument("--requantize", choices=sorted(FTYPES), default=None,
                        help="run the recipe's GGUF re-quantized to this type by llama.cpp (cached)")
    parser.add_argument("--kv", choices=["f16", "q8_0"], default="f16",
                        help="every method's KV cache type (q8_0: keys and values, flash attention)")
    parser.add_argument("--plain", action="store_true",
                        help="every prompt as plain text (chat messages' contents): for a base model's file, whose "
                             "tokenizer has no chat template")
    parser.add_argument("--eagle", action="store_true", help="add the shipped EAGLE-1 head on llama.cpp as a method")
    parser.add_argument("--eagle-k", type=int, default=3, help="the EAGLE method's most draft tokens a round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/llamacpp-backend")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = Recipe.load(resolve(args.recipe, "", "--recipe"))
    if args.requantize:
        args.gguf = requantized(base.target.source, args.requantize)
    if args.gguf is not None:
        base = dataclasses.replace(base, target=dataclasses.replace(base.target, source=str(args.gguf.resolve())))
    if args.kv != "f16":
        base = dataclasses.replace(base, kv=KVSpec.from_dict({"policy": "ggml_types", "type_k": args.kv,
                                                              "type_v": args.kv}, "--kv"))
    recipe = llamacpp_variant(base)
    if recipe is None:
        sys.exit(f"recipe {base.name}: no llama.cpp form (llama-cpp-python missing, not a GGUF target, or a "
                 "combination llama.cpp refuses)")
    gen = dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens, do_sample=False)
    ours = build(recipe)
    path = str(ours.target.gguf_path)
    eos = set(ours.eos_token_ids(gen))
    runners = {"ours": ours_runner(ours, sorted(eos)),
               "llamacpp_ar": llamacpp_runner(path, args.threads, eos, kv=args.kv),
               "llamacpp_lookup": llamacpp_runner(path, args.threads, eos, args.lookup_tokens, args.max_ngram, args.kv)}
    eagle = None
    if args.eagle:
        spec = {"drafter": "eagle", "num_draft_tokens": args.eagle_k, "adaptive": recipe.spec.adaptive}
        data = {**recipe.to_dict(), "name": f"{recipe.name}-eagle", "spec": spec,
                "draft": {"source": "embedded", "precision": "bf16"}}
        eagle = build(Recipe.from_dict(data), target=ours.target, tokenizer=ours.tokenizer)
        runners["ours_eagle"] = ours_runner(eagle, sorted(eos))
    for lm in (ours, eagle):  # the widest verify once (llama.cpp grows its logits buffer) and the cost curve
        if lm is not None:
            lm.warm_up(1024 + args.max_new_tokens)
    import llama_cpp

    report = {"cpu": cpu_isa(), "environment": environment(), "llama_cpp": llama_cpp.__version__,
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"), "threads": args.threads,
              "gguf": Path(path).name, "plain": args.plain, "kv": args.kv, "recipe": base.name,
              "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "verify_ms": [round(x, 1) for x in ours.verify_cost.step_ms[:16]],
              "engine": ours.engine_note, "perplexity": perplexity_pair(ours), "suites": {}}
    for suite in args.suites:
        prompts = spread(load_suite(SUITES[suite]), args.num_prompts)
        items = [Prompt(p.id, p.kind, ours.encode(plain_text(p.prompt) if args.plain else p.prompt,
                                                  f"prompts.{p.id}")) for p in prompts]
        measured = measure(runners, items, gen, repeats=args.repeats, warmup=1, rotate=True, desc=suite,
                           warm_gen=dataclasses.replace(gen, max_new_tokens=min(16, gen.max_new_tokens)),
                           before_repetition=lambda rep: [lm.forget() for lm in (ours, eagle) if lm is not None])
        report["suites"][suite] = suite_result(measured, list(runners))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "llamacpp_backend.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
