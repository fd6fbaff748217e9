"""``toolkit run RECIPE --batch-size N [--prompts FILE.jsonl] [--compare]``: a file of prompts through batched
speculative decoding, throughput next to HF batched AR and our single-row decoder on the same prompts.

Methods (``--compare``), each over ALL prompts, interleaved within every repetition, a fresh drafter state per
repetition (memory across requests holds only the earlier prompts of that repetition):

* ``ours-batch`` — :meth:`toolkit.speculative_lm.SpeculativeLM.generate_batch` with ``batch_size`` rows per forward;
* ``hf-batch-ar`` — HF ``generate`` on left-padded batches of ``batch_size`` prompts (AR, greedy);
* ``ours-single`` — our decoder one prompt at a time (the recipe as ``toolkit run`` runs it).

Throughput = all new tokens / wall time of the method over all prompts; median [min-max] over repetitions; peak RSS
(CPU) or peak allocated memory (CUDA) of each call. Greedy rows of ``ours-batch`` are checked token for token against
``ours-single`` (each prompt alone). Results: ``<out>/<name>-<hash>-batch<N>.{json,md}``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.measure.harness import environment, repetitions
from toolkit.measure.timing import Summary, synchronize

METHODS = ("ours-batch", "hf-batch-ar", "ours-single")


def hf_batch_generate(model, tokenizer, inputs: list[torch.Tensor], gen, eos_ids: list[int],
                      batch_size: int) -> list[list[int]]:
    """HF AR ``generate`` over left-padded batches; each row's new ids, cut after its EOS (HF pads finished rows)."""
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = gen.max_new_tokens, None, False
    config.eos_token_id = [] if gen.ignore_eos or not eos_ids else list(eos_ids)
    pad = getattr(tokenizer, "pad_token_id", None)  # no tokenizer (token-id prompts): EOS, else 0
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    config.pad_token_id = pad
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for start in range(0, len(inputs), batch_size):
        chunk = [x[0] for x in inputs[start:start + batch_size]]
        width = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, width - len(x):], mask[i, width - len(x):] = x, 1
        with torch.no_grad():
            result = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for row in result[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in config.eos_token_id), len(row))
            out.append(row[:cut])
    return out


def _runners(generator, inputs, prompts, gen, batch_size: int, kv_peaks: list | None = None) -> dict:
    eos = generator.eos_token_ids(gen)
    overrides = {"max_new_tokens": gen.max_new_tokens, "ignore_eos": gen.ignore_eos}

    def ours_batch() -> list[list[int]]:
        results = generator.generate_batch(prompts, batch_size, **overrides)
        if kv_peaks is not None:  # the batch cache's peak (a recipe run one request at a time: each row's own)
            kv_peaks.append(max(r.stats.peak_kv_bytes_batch or r.stats.peak_kv_bytes_target for r in results))
        return [r.token_ids for r in results]

    return {
        "ours-batch": ours_batch,
        "hf-batch-ar": lambda: hf_batch_generate(generator.target, generator.tokenizer, inputs, gen, eos, batch_size),
        "ours-single": lambda: [generator.generate(p, **overrides).token_ids for p in prompts],
    }


def run_batch(generator, prompts: list, batch_size: int, compare: bool = False, repeats: int = 3, gen=None,
              methods: list[str] | None = None, reuse: dict | None = None, deadline: float | None = None,
              progress: bool = False) -> dict:
    """Time the methods of the module docstring over ``prompts`` (strings, chat messages or ``(1, n)`` token ids);
    returns the JSON-able result.

    ``gen``: the generation settings (default the recipe's; only ``max_new_tokens`` and ``ignore_eos`` reach HF);
    ``methods``: which of :data:`METHODS` to time (default all with ``compare``, else ``ours-batch``); ``reuse``: a
    dict kept by the caller across calls — an ``hf-batch-ar`` measurement of the same model object, prompts, settings
    and batch size is taken from it instead of timed again (the search's trials share it); ``deadline``: a
    ``time.monotonic()`` value after which no further repetition starts (at least one runs; ``repeats`` in the
    result is the number that ran); ``progress``: a progress bar over the timed calls (with the time left).
    """
    from tqdm.auto import tqdm

    from eval.metrics import PeakMemory

    gen = gen or generator.recipe.generation
    inputs = [generator.encode(p) for p in prompts]
    kv_peaks: list[int] = []
    runners = _runners(generator, inputs, prompts, gen, batch_size, kv_peaks)
    methods = [m for m in METHODS if m in (methods or (METHODS if compare else ["ours-batch"]))]
    if "ours-batch" not in methods:
        raise ValueError(f"run_batch: methods must include 'ours-batch', got {methods}")
    key = ("hf-batch-ar", id(generator.target), tuple(tuple(x[0].tolist()) for x in inputs), gen.max_new_tokens,
           gen.ignore_eos, batch_size, repeats)
    reused = reuse.get(key) if reuse is not None and "hf-batch-ar" in methods else None
    timed = [m for m in methods if not (reused and m == "hf-batch-ar")]
    device = next(generator.target.parameters()).device
    for method in timed:  # warm-up: kernels, allocator, the verify cost curve for batches
        generator.forget()
        _runners(generator, inputs[:2], prompts[:2], gen, batch_size)[method]()
    times = {m: [] for m in timed}
    outputs, peaks = {}, {m: [] for m in timed}
    bar = tqdm(total=repeats * len(timed), desc=f"batch {generator.recipe.name} (B={batch_size})", unit="run",
               disable=not progress)
    done = 0  # repetitions that ran (a time budget may end them early)
    for rep in repetitions(repeats, deadline):
        done = rep + 1
        for method in timed[rep % len(timed):] + timed[:rep % len(timed)]:
            generator.forget()
            synchronize(device)
            with PeakMemory(str(device)) as meter:
                start = time.perf_counter()
                outputs[method] = runners[method]()
                synchronize(device)
                times[method].append(time.perf_counter() - start)
            peaks[method].append(meter.result)
            bar.set_postfix(method=method, tok_s=f"{sum(map(len, outputs[method])) / times[method][-1]:.1f}")
            bar.update()
    bar.close()
    if reused:
        times["hf-batch-ar"], outputs["hf-batch-ar"], peaks["hf-batch-ar"] = reused
    elif reuse is not None and "hf-batch-ar" in timed and done == repeats:  # only a full measurement is reused
        reuse[key] = (times["hf-batch-ar"], outputs["hf-batch-ar"], peaks["hf-batch-ar"])
    result = _summary(generator, prompts, batch_size, methods, times, outputs, peaks, done, gen)
    result["summary"]["ours-batch"]["kv_peak_bytes"] = max(kv_peaks)
    if reused:
        result["summary"]["hf-batch-ar"]["reused"] = True
    return result


def _summary(generator, prompts, batch_size, methods, times, outputs, peaks, repeats, gen) -> dict:
    summary = {}
    for m in methods:
        tokens = sum(len(ids) for ids in outputs[m])
        summary[m] = {"new_tokens": tokens, "throughput": Summary.of([tokens / t for t in times[m]]).to_dict(),
                      "peak_rss_bytes": max((p.get("peak_rss_bytes") or p.get("peak_allocated_bytes") or 0)
                                            for p in peaks[m])}
    ours = summary["ours-batch"]["throughput"]["median"]
    for m in methods[1:]:
        summary["ours-batch"][f"speedup_vs_{m}"] = ours / summary[m]["throughput"]["median"]
    identical = None
    if "ours-single" in outputs and not gen.do_sample:
        identical = [a == b for a, b in zip(outputs["ours-batch"], outputs["ours-single"])]
    recipe = generator.recipe
    return {"recipe": recipe.to_dict(), "config_hash": recipe.config_hash(), "batch_size": batch_size,
            "batched": generator.batchable and batch_size > 1, "prompts": len(prompts), "repeats": repeats,
            "summary": summary,
            "rows_identical_to_single": identical, "environment": environment()}


def markdown(result: dict) -> str:
    source = f" of {result['prompts_source']}" if result.get("prompts_source") else ""
    single = "" if result["batched"] else " (this recipe runs one request at a time)"
    lines = [f"## {result['recipe']['name']} ({result['config_hash']}): {result['prompts']} prompts{source}, "
             f"batch size {result['batch_size']}{single}",
             "", "| method | new tokens | tok/s median [min-max] | vs ours-batch | peak RSS |", "|---|---|---|---|---|"]
    ours = result["summary"]["ours-batch"]["throughput"]["median"]
    for m, s in result["summary"].items():
        t = s["throughput"]
        lines.append(f"| {m} | {s['new_tokens']} | {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | "
                     f"{ours / t['median']:.2f}× | {s['peak_rss_bytes'] / 2**20:.0f} MiB |")
    same = result["rows_identical_to_single"]
    if same is not None:
        lines += ["", f"Rows identical to the prompt decoded alone: {sum(same)}/{len(same)}."]
    lines += ["", f"device: {result['environment']['hardware']} ({result['environment']['torch_threads']} threads); "
              f"{result['repeats']} timed repetition(s)"]
    return "\n".join(lines) + "\n"


def write_batch_results(result: dict, out_dir: Path) -> Path:
    """Write ``<out_dir>/<name>-<hash>[-<prompts_source>]-batch<N>.{json,md}`` (``result["prompts_source"]`` names the
    prompt file or suite, so runs of one recipe over different prompts do not overwrite each other); returns the
    JSON's path."""
    from eval.run import result_stem

    stem = result_stem(result["recipe"]["name"], result["config_hash"], result.get("prompts_source") or "")
    path = Path(out_dir) / f"{stem}-batch{result['batch_size']}.json"
    atomic_write_json(path, result)
    atomic_write_text(path.with_suffix(".md"), markdown(result))
    return path


def batch_methods(baselines: bool | list[str]) -> list[str]:
    """The batch stage's methods for ``EvalSettings.baselines``: every one of :data:`METHODS` (``True``), ours only
    (``False`` or an empty list), or ours and those the list names."""
    if baselines is True:
        return list(METHODS)
    return ["ours-batch"] + [m for m in METHODS[1:] if baselines and m in baselines]


def batch_section(generator, prompts: list, prompt_ids: list[str], gen, repeats: int, baselines,
                  reuse: dict | None, deadline: float | None = None, progress: bool = False) -> dict:
    """The ``batch`` section of an evaluation of a recipe that sets ``batch_size``: :func:`run_batch` over
    ``prompts`` (``(1, n)`` token ids, named ``prompt_ids``) at the recipe's batch size.

    ``baselines``: ``True`` (HF batched AR and our single-row decoder), ``False`` (ours only) or a list naming
    ``hf-batch-ar`` / ``ours-single``. Returns ``{batch_size, batched, prompts (ids), repeats (that ran), methods:
    {method: {throughput, new_tokens, peak_rss_bytes}}, ratios, rows_identical_to_single, kv_peak_bytes}``.
    """
    result = run_batch(generator, prompts, generator.recipe.rows_per_forward, repeats=repeats, gen=gen,
                       methods=batch_methods(baselines), reuse=reuse, deadline=deadline, progress=progress)
    summary = result["summary"]
    ours = summary["ours-batch"]
    ratios = {f"ours_batch_vs_{m.replace('-', '_')}": ours[f"speedup_vs_{m}"] for m in summary if m != "ours-batch"}
    methods = {m: {k: v for k, v in s.items() if not k.startswith("speedup_vs_") and k != "kv_peak_bytes"}
               for m, s in summary.items()}
    return {"batch_size": result["batch_size"], "batched": result["batched"], "prompts": list(prompt_ids),
            "repeats": result["repeats"], "methods": methods, "ratios": ratios,
            "rows_identical_to_single": result["rows_identical_to_single"], "kv_peak_bytes": ours["kv_peak_bytes"]}
