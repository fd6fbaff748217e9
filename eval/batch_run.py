"""``toolkit run RECIPE --batch-size N [--prompts FILE.jsonl] [--compare]``: a file of prompts through batched
speculative decoding, throughput next to HF batched AR and our single-row decoder on the same prompts.

Methods (``--compare``), each over ALL prompts, interleaved within every repetition, a fresh drafter state per
repetition (memory across requests holds only the earlier prompts of that repetition):

* ``ours-batch`` — :meth:`toolkit.generator.Generator.generate_batch` with ``batch_size`` rows per forward;
* ``hf-batch-ar`` — HF ``generate`` on left-padded batches of ``batch_size`` prompts (AR, greedy);
* ``ours-single`` — our decoder one prompt at a time (the recipe as ``toolkit run`` runs it).

Throughput = all new tokens / wall time of the method over all prompts; median [min-max] over repetitions; peak RSS
(CPU) or peak allocated memory (CUDA) of each call. Greedy rows of ``ours-batch`` are checked token for token against
``ours-single`` (each prompt alone). Results: ``<out>/<name>-<hash>-batch<N>.{json,md}``.
"""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path

import torch

from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_text
from toolkit.measure.harness import environment
from toolkit.measure.timing import Summary, synchronize

METHODS = ("ours-batch", "hf-batch-ar", "ours-single")


def load_prompt_file(path: str | Path) -> list:
    """Prompts of a JSONL file: one per line, ``{"prompt": "text"}``, ``{"messages": [...]}`` or a JSON string.

    Raises:
        ConfigError: unreadable file, a line that is not JSON, or a line of another shape (the line is named).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--prompts", f"cannot read {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--prompts:{number}", f"not JSON: {exc.msg}") from None
        if isinstance(item, dict) and isinstance(item.get("messages"), list):
            item = item["messages"]
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = item["prompt"]
        if not (isinstance(item, str) and item) and not (isinstance(item, list) and item):
            raise ConfigError(f"--prompts:{number}", 'expected {"prompt": "text"}, {"messages": [...]} or a string')
        prompts.append(item)
    if not prompts:
        raise ConfigError("--prompts", f"{path} holds no prompt")
    return prompts


def hf_batch_generate(model, tokenizer, inputs: list[torch.Tensor], gen, eos_ids: list[int],
                      batch_size: int) -> list[list[int]]:
    """HF AR ``generate`` over left-padded batches; each row's new ids, cut after its EOS (HF pads finished rows)."""
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = gen.max_new_tokens, None, False
    config.eos_token_id = [] if gen.ignore_eos or not eos_ids else list(eos_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
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


def _runners(generator, inputs, prompts, gen, batch_size: int) -> dict:
    eos = generator.eos_token_ids(gen)
    overrides = {"max_new_tokens": gen.max_new_tokens, "ignore_eos": gen.ignore_eos}
    return {
        "ours-batch": lambda: [r.token_ids for r in generator.generate_batch(prompts, batch_size, **overrides)],
        "hf-batch-ar": lambda: hf_batch_generate(generator.target, generator.tokenizer, inputs, gen, eos, batch_size),
        "ours-single": lambda: [generator.generate(p, **overrides).token_ids for p in prompts],
    }


def run_batch(generator, prompts: list, batch_size: int, compare: bool = False, repeats: int = 3) -> dict:
    """Time the methods of the module docstring over ``prompts``; returns the JSON-able result."""
    from eval.metrics import PeakMemory

    gen = generator.recipe.generation
    inputs = [generator.encode(p) for p in prompts]
    runners = _runners(generator, inputs, prompts, gen, batch_size)
    methods = list(METHODS) if compare else ["ours-batch"]
    device = next(generator.target.parameters()).device
    for method in methods:  # warm-up: kernels, allocator, the verify cost curve for batches
        generator.forget()
        _runners(generator, inputs[:2], prompts[:2], gen, batch_size)[method]()
    times = {m: [] for m in methods}
    outputs, peaks = {}, {m: [] for m in methods}
    for rep in range(repeats):
        for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
            generator.forget()
            synchronize(device)
            with PeakMemory(str(device)) as meter:
                start = time.perf_counter()
                outputs[method] = runners[method]()
                synchronize(device)
                times[method].append(time.perf_counter() - start)
            peaks[method].append(meter.result)
    return _summary(generator, prompts, batch_size, methods, times, outputs, peaks, repeats)


def _summary(generator, prompts, batch_size, methods, times, outputs, peaks, repeats) -> dict:
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
    if "ours-single" in outputs and not generator.recipe.generation.do_sample:
        identical = [a == b for a, b in zip(outputs["ours-batch"], outputs["ours-single"])]
    recipe = generator.recipe
    return {"recipe": recipe.to_dict(), "config_hash": recipe.config_hash(), "batch_size": batch_size,
            "batched": generator.batchable, "prompts": len(prompts), "repeats": repeats, "summary": summary,
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
    lines += ["", f"device: {result['environment']['hardware']} ({result['environment']['torch_threads']} threads)"]
    return "\n".join(lines) + "\n"


def write_batch_results(result: dict, out_dir: Path) -> Path:
    """Write ``<out_dir>/<name>-<hash>[-<prompts_source>]-batch<N>.{json,md}`` (``result["prompts_source"]`` names the
    prompt file or suite, so runs of one recipe over different prompts do not overwrite each other); returns the
    JSON's path."""
    label = re.sub(r"[^A-Za-z0-9._-]", "_", result.get("prompts_source") or "").strip("._")
    stem = "-".join(part for part in (result["recipe"]["name"], result["config_hash"], label) if part)
    path = Path(out_dir) / f"{stem}-batch{result['batch_size']}.json"
    atomic_write_json(path, result)
    atomic_write_text(path.with_suffix(".md"), markdown(result))
    return path
