"""Peak memory of converting a 0.5B GGUF: the issue's "a user brings a Qwen2.5-0.5B GGUF" case, without the hub.

Writes a GGUF of Qwen2.5-0.5B's exact shape (qwen2: 24 layers, hidden 896, MLP 4864, 14 / 2 heads, q/k/v biases,
tied embeddings, vocabulary 151 936: 494 M parameters) with random weights quantized to Q8_0 by the ``gguf``
package, carrying the embedded SmolLM2 tokenizer (transformers' GGUF loader builds the tokenizer from it), then
converts it the way ``--target FILE.gguf`` does (:func:`toolkit.models.embedded.convert_gguf`) once per cache dtype,
each in a fresh process whose peak RSS (``ru_maxrss``) is read by its parent. Writes
``bench/results/gguf_peak.{json,md}`` (committed copy: ``bench/reports/gguf/``).

    python bench/gguf_peak.py [--dtypes float32 bfloat16] [--gguf /tmp/qwen05-shape-q8_0.gguf]   # make bench-gguf
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"layers": 24, "hidden": 896, "ffn": 4864, "heads": 14, "kv_heads": 2, "vocab": 151936}


def write_gguf(path: Path, seed: int = 0) -> Path:
    """The Qwen2.5-0.5B-shaped Q8_0 GGUF described in the module docstring."""
    import gguf
    from gguf.quants import quantize

    from toolkit.models import embedded_gguf_path

    s = SHAPE
    head_dim = s["hidden"] // s["heads"]
    reader = gguf.GGUFReader(embedded_gguf_path())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in ("general.architecture", "general.quantization_version",
                                                             "general.file_type"):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in (("qwen2.context_length", 32768), ("qwen2.embedding_length", s["hidden"]),
                       ("qwen2.block_count", s["layers"]), ("qwen2.feed_forward_length", s["ffn"]),
                       ("qwen2.attention.head_count", s["heads"]), ("qwen2.attention.head_count_kv", s["kv_heads"]),
                       ("qwen2.vocab_size", s["vocab"])):
        writer.add_uint32(key, value)
    writer.add_float32("qwen2.rope.freq_base", 1000000.0)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    rng = np.random.default_rng(seed)

    def q8(*shape):  # numpy order (out, in); quantized along the last axis in blocks of 32
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        return quantize(w, gguf.GGMLQuantizationType.Q8_0)

    def f32(n, value=None):
        return np.full(n, value, dtype=np.float32) if value is not None else \
            (rng.standard_normal(n, dtype=np.float32) * 0.02)

    Q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", q8(s["vocab"], s["hidden"]), raw_dtype=Q8)
    writer.add_tensor("output_norm.weight", f32(s["hidden"], 1.0))
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        for name, shape in (("attn_q", (s["hidden"], s["hidden"])), ("attn_k", (kv, s["hidden"])),
                            ("attn_v", (kv, s["hidden"])), ("attn_output", (s["hidden"], s["hidden"])),
                            ("ffn_gate", (s["ffn"], s["hidden"])), ("ffn_up", (s["ffn"], s["hidden"])),
                            ("ffn_down", (s["hidden"], s["ffn"]))):
            writer.add_tensor(f"blk.{i}.{name}.weight", q8(*shape), raw_dtype=Q8)
        for name, size in (("attn_q", s["hidden"]), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"blk.{i}.{name}.bias", f32(size))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", f32(s["hidden"], 1.0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_CHILD = """
import resource, sys, time, json, torch
from pathlib import Path
from toolkit.models.embedded import convert_gguf
dtype = getattr(torch, sys.argv[3])
t0 = time.perf_counter()
out = convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), dtype=dtype)
seconds = time.perf_counter() - t0
size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
print(json.dumps({"seconds": seconds, "cache_bytes": size,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


_LOAD_CHILD = """
import resource, sys, json
from toolkit.models import load_model
from toolkit.models.sizes import weight_bytes
from toolkit.recipe import ModelSpec
import torch
model, _ = load_model(ModelSpec(source=sys.argv[1], precision=sys.argv[2]))
with torch.inference_mode():  # one short forward: every weight page is touched (safetensors maps them lazily)
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"weight_bytes": weight_bytes(model),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def load(gguf_path: Path, precision: str, cache: Path) -> dict:
    """Load the GGUF as a recipe's target at ``precision`` in a fresh process (the cached copy already made, as on
    every run after the first) and run one 4-token forward; its peak RSS and the loaded model's weight bytes."""
    import os

    env = dict(os.environ, TOOLKIT_CACHE_DIR=str(cache))
    result = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(gguf_path), precision], capture_output=True,
                            text=True, cwd=REPO, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def convert(gguf_path: Path, dtype: str) -> dict:
    """Convert in a fresh process (its own cache directory); its peak RSS and the cache's size."""
    with tempfile.TemporaryDirectory(prefix="gguf-peak-") as tmp:
        result = subprocess.run([sys.executable, "-c", _CHILD, str(gguf_path), str(Path(tmp) / "copy"), dtype],
                                capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--gguf", type=Path, default=Path(tempfile.gettempdir()) / "qwen05-shape-q8_0.gguf")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--load", nargs="*", default=["fp32", "bf16", "int4"],
                        help="recipe precisions to load the GGUF at afterwards (peak RSS of loading)")
    args = parser.parse_args()
    if not args.gguf.is_file():
        t0 = time.perf_counter()
        write_gguf(args.gguf)
        print(f"wrote {args.gguf} ({args.gguf.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    s = SHAPE
    kv = s["kv_heads"] * s["hidden"] // s["heads"]
    params = s["layers"] * (2 * s["hidden"] ** 2 + 2 * kv * s["hidden"] + 3 * s["ffn"] * s["hidden"] + s["hidden"]
                            + 2 * kv + 2 * s["hidden"]) + s["vocab"] * s["hidden"] + s["hidden"]
    rows = []
    for dtype in args.dtypes:
        r = convert(args.gguf, dtype)
        model_bytes = r["cache_bytes"]
        rows.append({"dtype": dtype, **r, "peak_over_model": r["peak_rss_bytes"] / model_bytes})
        print(f"{dtype}: {r['seconds']:.0f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, cache "
              f"{model_bytes / 2**30:.2f} GiB (peak = {rows[-1]['peak_over_model']:.2f}x the model)", flush=True)
    loads = []
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as cache:
        for precision in args.load:
            load(args.gguf, precision, Path(cache))  # the first load converts; the second is what runs see
            r = load(args.gguf, precision, Path(cache))
            loads.append({"precision": precision, **r, "peak_over_model": r["peak_rss_bytes"] / r["weight_bytes"]})
            print(f"load {precision}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, weights "
                  f"{r['weight_bytes'] / 2**30:.2f} GiB ({loads[-1]['peak_over_model']:.2f}x)", flush=True)
    result = {"gguf": str(args.gguf), "gguf_bytes": args.gguf.stat().st_size, "shape": SHAPE, "params": params,
              "rows": rows, "loads": loads,
              "parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    args.out.mkdir(parents=True, exist_ok=True)
    from toolkit.io import atomic_write_json, atomic_write_text

    atomic_write_json(args.out / "gguf_peak.json", result)
    lines = [f"# Converting a {params / 1e6:.0f} M-parameter GGUF (Qwen2.5-0.5B's shape, Q8_0, "
             f"{result['gguf_bytes'] / 2**20:.0f} MiB)", "",
             "One fresh process per cache dtype (`convert_gguf`, what `--target FILE.gguf` runs); peak RSS counts the "
             "memory-mapped GGUF pages it touched.", "",
             "| cache dtype | conversion s | peak RSS GiB | peak RSS GB | cache GiB | peak / model |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seconds']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
              f"{r['peak_rss_bytes'] / 1e9:.2f} | {r['cache_bytes'] / 2**30:.2f} | {r['peak_over_model']:.2f} |"
              for r in rows]
    if loads:
        lines += ["", "Loading it as a recipe's target afterwards (fresh process, cached copy present, one 4-token "
                  "forward):", "",
                  "| precision | peak RSS GiB | weights in memory GiB | peak / weights |", "|---|---|---|---|"]
        lines += [f"| {r['precision']} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['weight_bytes'] / 2**30:.2f} | "
                  f"{r['peak_over_model']:.2f} |" for r in loads]
    atomic_write_text(args.out / "gguf_peak.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
