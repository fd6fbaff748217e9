"""A GGUF at its own quality and in its own memory: ``precision: native`` against the re-quantized torchao int4 path and
against llama.cpp on the same file, one run.

    make bench-native-gguf        # needs .venv-engines (llama.cpp) for the llama.cpp columns: make bench-cpu-engines
    PYTHONPATH=. .venv/bin/python bench/native_gguf.py [--stages quality speed memory big] [--out DIR]

Stages (each saved as it finishes):

* ``quality`` — teacher-forced on 1,024 held-out tokens of prose and of code (``eval.data.heldout_ids``): perplexity,
  top-1 agreement with fp32 (transformers' dequantized copy of the file) and with llama.cpp's own argmax, for
  ``native``, torchao ``int4`` (today's re-quantized path) and llama.cpp on the file itself. Two files: the embedded
  model's Q4_1 GGUF, and a Q4_K_M file of another architecture (qwen2) made by llama.cpp's own quantizer from the
  embedded model's weights (written as an F32 qwen2 GGUF first: real weights, so perplexity means something).
* ``speed`` — the main recipe (``recipes/short.yaml``) on native weights against the same recipe on torchao int4,
  both on the compiled engine, methods interleaved per prompt, 4 ``make short`` prompts + 4 unseen, 96 new tokens,
  median of 3.
* ``memory`` — peak RSS of a first load of the embedded model at ``native`` (conversion included, fresh cache) in a
  child process, against the final weight bytes.
* ``big`` — a GGUF of Llama-3.1-8B's shape with random blocks in Q4_K_M's tensor types (Q4_K; Q6_K for the output,
  and for ``attn_v`` / ``ffn_down`` of the layers llama.cpp gives more bits), converted and asked for 10 tokens in a
  child process: peak RSS, seconds, weight bytes.

Writes ``<out>/native_gguf.json`` and ``<out>/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from eval.data import heldout_ids  # noqa: E402
from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure import engines  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.models.embedded import embedded_gguf_path, resolve_source  # noqa: E402
from toolkit.recipe import ModelSpec  # noqa: E402

STAGES = ("quality", "speed", "memory", "big")
LLAMA_8B = {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}


def cpu() -> dict:
    """The CPU as every CPU figure states it (:func:`toolkit.cpu.cpu_isa`), with torch's threads and
    version."""
    return cpu_isa() | {"threads": torch.get_num_threads(), "torch": torch.__version__}


def _nll_argmax(model, ids: list[int]) -> tuple[list[float], list[int]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    return (-logp.gather(1, torch.tensor(ids[1:]).view(-1, 1))[:, 0]).tolist(), logp.argmax(-1).tolist()


def _agree(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def quality_of(source: str, gguf: str, num_tokens: int) -> dict:
    """``{text: {method: {ppl, top1_vs_fp32, top1_vs_llamacpp}}}`` for one GGUF (see the module docstring)."""
    models = {name: load_model(ModelSpec(source=source, precision=precision, device="cpu"))
              for name, precision in (("fp32", "fp32"), ("native", "native"), ("int4 (torchao, re-quantized)", "int4"))}
    tokenizer = models["fp32"][1]
    out = {}
    for text in ("prose", "code"):
        ids = heldout_ids(tokenizer, text, num_tokens)
        scored = {name: _nll_argmax(model, ids) for name, (model, _) in models.items()}
        if "llamacpp_ar" in engines.available():
            with engines.EngineProcess(engines.ENGINES["llamacpp_ar"], gguf) as worker:
                reply = worker.request("score", input_ids=ids)
            scored["llama.cpp"] = (reply["nll"], reply["argmax"])
        out[text] = {name: {"ppl": math.exp(sum(nll) / len(nll)), "top1_vs_fp32": _agree(arg, scored["fp32"][1]),
                            **({"top1_vs_llamacpp": _agree(arg, scored["llama.cpp"][1])} if "llama.cpp" in scored
                               else {})}
                     for name, (nll, arg) in scored.items()}
        print(json.dumps({source: {text: out[text]}}), file=sys.stderr)
    out["native_layers"] = {k: len(models["native"][0].toolkit_native[k]) for k in ("native", "dequantized")}
    out["native_embedding"] = models["native"][0].toolkit_native["embedding"]
    out["native_dequantized_types"] = sorted({v["gguf_type"] for v in
                                              models["native"][0].toolkit_native["dequantized"].values()})
    return out


def write_qwen2_gguf(path: Path) -> Path:
    """The embedded model's fp32 weights (HF layout) written as an F32 qwen2 GGUF (zero q/k/v biases: the same
    function as the llama original), the embedded tokenizer carried."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_source("embedded"), dtype=torch.float32).requires_grad_(False)
    c = model.config
    reader = gguf.GGUFReader(embedded_gguf_path())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in ("general.architecture", "general.file_type"):
            continue
        writer.add_key_value(name, field.contents(), field.types[0],
                             sub_type=field.types[1] if len(field.types) > 1 else None)
    for key, value in (("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("block_count", c.num_hidden_layers), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", model.model.embed_tokens.weight.numpy())
    writer.add_tensor("output_norm.weight", model.model.norm.weight.numpy())
    for i, layer in enumerate(model.model.layers):
        for module_name, module in layer.named_modules():
            short = module_name.rsplit(".", 1)[-1]
            if short in names:
                writer.add_tensor(f"blk.{i}.{names[short]}.weight", module.weight.detach().numpy())
        for proj in ("q_proj", "k_proj", "v_proj"):  # qwen2 has q/k/v biases: zero, the llama function
            rows = getattr(layer.self_attn, proj).out_features
            writer.add_tensor(f"blk.{i}.{names[proj]}.bias", np.zeros(rows, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def qwen2_q4_k_m(work: Path) -> Path | None:
    """The Q4_K_M qwen2 file made by llama.cpp's quantizer (``None`` without .venv-engines)."""
    python = engines.engines_python()
    if python is None:
        return None
    out = work / "smollm2-as-qwen2.Q4_K_M.gguf"
    if not out.is_file():
        source = write_qwen2_gguf(work / "smollm2-as-qwen2.F32.gguf")
        subprocess.run([python, "-c", _QUANTIZE, str(source), str(out)], check=True, capture_output=True)
        source.unlink()
    return out


def stage_quality(args, report: dict) -> None:
    report["quality"] = {"embedded Q4_1": quality_of("embedded", str(embedded_gguf_path()), args.tokens)}
    q4km = qwen2_q4_k_m(Path(args.work))
    if q4km is not None:
        import gguf

        report["quality_files"] = {"qwen2 Q4_K_M": sorted({t.tensor_type.name for t in gguf.GGUFReader(q4km).tensors})}
        report["quality"]["qwen2 Q4_K_M (llama.cpp quantize)"] = quality_of(str(q4km), str(q4km), args.tokens)


def stage_speed(args, report: dict) -> None:
    """The main recipe on native vs torchao int4 weights, both compiled, interleaved per prompt (one process)."""
    from eval.runners import ours_runner
    from toolkit.measure.harness import Prompt, measure, spread
    from toolkit.measure.prompts import load_suite
    from toolkit.recipe import GenerationSpec, Recipe
    from toolkit.resources import resolve
    from toolkit.speculative_lm import build

    recipe = Recipe.load(resolve("short", "", "recipe"))
    variants = {"ours native": "native", "ours int4 (torchao)": "int4"}
    generators = {name: build(recipe.replace(target=dataclasses.replace(recipe.target, precision=precision)))
                  for name, precision in variants.items()}
    gen = GenerationSpec(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    any_gen = next(iter(generators.values()))
    unseen = load_suite(str(ROOT / "bench/prompts/unseen.yaml"))
    suites = {"short": spread(load_suite("short"), 4), "unseen": spread(unseen, 4)}
    out = {"cpu": cpu()}
    for suite, prompts in suites.items():
        items = [Prompt(p.id, p.kind, any_gen.encode(p.prompt, p.id)) for p in prompts]
        longest = max(int(i.input_ids.shape[1]) for i in items) + gen.max_new_tokens
        out.setdefault("compile_s", {}).update({n: round(g.warm_up(longest), 1) for n, g in generators.items()})
        out["paths"] = {n: g.engine_note for n, g in generators.items()}
        eos = any_gen.eos_token_ids(gen)
        runners = {name: ours_runner(g, eos) for name, g in generators.items()}
        measured = measure(runners, items, gen, repeats=args.repeats, warmup=1, desc=f"speed {suite}",
                           before_repetition=lambda rep: [g.forget() for g in generators.values()])
        speed = {name: measured.speed(name)["throughput"] for name in runners}
        names = list(runners)
        out[suite] = {"tok_s": speed, "ratio_native_vs_int4": measured.paired_ratio(names[0], names[1]),
                      "same_text": sum(a.token_ids == b.token_ids for a, b in zip(measured.last(names[0]),
                                                                                   measured.last(names[1])))}
        print(json.dumps({suite: out[suite]}), file=sys.stderr)
    report["speed"] = out


_LOAD = """
import json, resource, sys, time, torch
torch.set_num_threads(2)
from toolkit.models import load_model
from toolkit.models.sizes import weight_bytes
from toolkit.recipe import ModelSpec
started = time.perf_counter()
model, tokenizer = load_model(ModelSpec(source=sys.argv[1], precision="native", device="cpu"))
loaded = time.perf_counter() - started
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
started = time.perf_counter()
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=int(sys.argv[2]), do_sample=False, min_new_tokens=int(sys.argv[2]))
print(json.dumps({"load_s": loaded, "generate_s": time.perf_counter() - started, "new_tokens": out.shape[1] - 8,
                  "weight_bytes": weight_bytes(model), "dequantized": sorted(model.toolkit_native["dequantized"]),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _first_load(source: str, new_tokens: int) -> dict:
    """A first native load of ``source`` (fresh cache: conversion included) in a child process, then a greedy
    generation of ``new_tokens``: seconds, weight bytes and peak RSS."""
    import os

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TOOLKIT_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", _LOAD, source, str(new_tokens)], env=env, check=True,
                              capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["bound_bytes"] = int(1.5 * result["weight_bytes"] + 2**30)
    result["within_bound"] = result["peak_rss_bytes"] <= result["bound_bytes"]
    return result


def stage_memory(args, report: dict) -> None:
    size = embedded_gguf_path().stat().st_size
    report["memory"] = {"embedded Q4_1": _first_load("embedded", 10) | {"file_bytes": size}}


def write_llama8b_q4_k_m(path: Path, layers: int | None = None) -> Path:
    """Random blocks in Q4_K_M's tensor types at Llama-3.1-8B's shape (see the module docstring)."""
    import gguf
    from gguf_files import write_llama_gguf

    s = dict(LLAMA_8B, layers=layers or LLAMA_8B["layers"])
    Q4K, Q6K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    more_bits = {i for i in range(s["layers"]) if i < s["layers"] // 8 or i >= 7 * s["layers"] // 8
                 or (i - s["layers"] // 8) % 3 == 2}  # llama.cpp's use_more_bits for attn_v / ffn_down

    def qtype(kind: str, layer: int | None):
        return Q6K if kind == "output" or (kind in ("attn_v", "ffn_down") and layer in more_bits) else Q4K

    return write_llama_gguf(path, types=qtype, hidden=s["hidden"], ffn=s["ffn"], heads=s["heads"],
                            kv_heads=s["kv_heads"], layers=s["layers"], vocab=s["vocab"], output=True)


def stage_big(args, report: dict) -> None:
    path = Path(args.work) / "llama-3.1-8b-shape.Q4_K_M.gguf"
    if not path.is_file():
        write_llama8b_q4_k_m(path)
    result = _first_load(str(path), 10)
    report["big"] = result | {"file_bytes": path.stat().st_size, "shape": LLAMA_8B}
    path.unlink()


def markdown(report: dict) -> str:
    machine = report["cpu"]
    lines = ["# Native GGUF weights (`precision: native`)", "", f"CPU: {cpu_line(machine)}; "
             f"{machine['threads']} threads; torch {machine['torch']}.", ""]
    for file, texts in report.get("quality", {}).items():
        lines += [f"## Quality: {file}", "", "| text | method | PPL | top-1 vs fp32 | top-1 vs llama.cpp |",
                  "|---|---|---|---|---|"]
        for text in ("prose", "code"):
            for name, q in texts[text].items():
                lines.append(f"| {text} | {name} | {q['ppl']:.3f} | {q['top1_vs_fp32']:.3f} | "
                             f"{q.get('top1_vs_llamacpp', float('nan')):.3f} |")
        embedding = texts.get("native_embedding", {})
        lines += ["", f"Native layers: {texts['native_layers']}; kept dequantized: "
                  f"{texts['native_dequantized_types'] or 'none'}; input embedding: "
                  f"{embedding.get('gguf_type', '?')} kept as {embedding.get('kept_as', 'bf16')}.", ""]
    if "speed" in report:
        s = report["speed"]
        lines += ["## Speed: the main recipe, native vs torchao int4 (compiled engine, interleaved, median of "
                  f"{report['args']['repeats']})", "", "| suite | ours native tok/s | ours int4 tok/s | native / int4 "
                  "(paired) | same text |", "|---|---|---|---|---|"]
        for suite in ("short", "unseen"):
            t = s[suite]["tok_s"]
            lines.append(f"| {suite} | {t['ours native']['median']:.1f} | {t['ours int4 (torchao)']['median']:.1f} | "
                         f"{s[suite]['ratio_native_vs_int4']:.2f}x | {s[suite]['same_text']}/4 |")
        lines += ["", f"Decoding paths: {s.get('paths') or 'compiled static engine for both (compile: auto)'}; graphs "
                  f"compiled before timing (s): {s['compile_s']}.", ""]
    for key, title in (("memory", "First load, embedded model"), ("big", "Llama-3.1-8B shape, Q4_K_M types")):
        if key in report:
            m = report[key] if key == "big" else report[key]["embedded Q4_1"]
            lines += [f"## {title}", "", f"peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GiB (bound 1.5 x weights + 1 GiB "
                      f"= {m['bound_bytes'] / 2**30:.2f} GiB: {'met' if m['within_bound'] else 'missed'}); weights "
                      f"{m['weight_bytes'] / 2**30:.2f} GiB; file {m['file_bytes'] / 2**30:.2f} GiB; load (conversion "
                      f"included) {m['load_s']:.0f} s; {m['new_tokens']} tokens in {m['generate_s']:.1f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--out", default=str(ROOT / "bench/reports/native-gguf"))
    parser.add_argument("--work", default=tempfile.gettempdir(), help="where the generated GGUF files go")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "native_gguf.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report.update(cpu=cpu(), args=vars(args))
    for stage in args.stages:
        started = time.perf_counter()
        globals()[f"stage_{stage}"](args, report)
        print(f"{stage}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        atomic_write_json(path, report)
        atomic_write_text(out / "README.md", markdown(report))


if __name__ == "__main__":
    main()
