"""Does the verify width change llama.cpp's logits? The same tokens scored one per ``llama_decode`` (what llama.cpp's
own greedy AR does) and in verify forwards of ``W`` tokens (what the decoder's verify does), through the toolkit's
llama.cpp target forward, per GGUF file and context setting.

    PYTHONPATH=. .venv/bin/python bench/llamacpp_width.py [--requantize Q4_0 Q4_K_M] [--gguf FILE ...]
        [--suite short-heldout] [--num-prompts 3] [--tokens 64] [--widths 2 4 8] [--split 256] [--threads 2]
        [--out bench/reports/llamacpp-width]

Per prompt: the prompt is prefilled, 64 tokens are decoded greedily one at a time (their logits are the reference),
the cache rolls back to the prompt and the same tokens are fed again in forwards of ``W`` tokens (teacher forcing).
Reported per file, setting and ``W``: the largest ``|Δ logit|`` over the vocabulary at a position (median and max over
positions, and the max at up to / past ``--split`` cached positions: ggml's f16 flash attention changes path past
256), the positions whose argmax changes, and the reference's top-2 margin there; and per file and setting the
verify cost curve through the same forward (:func:`toolkit.engine.cost.measure_verify_cost`, ms for 1-8 tokens after
256 of context): what a verify of ``W`` tokens costs against a one-token step on these block types. Where the
argmax changes, a speculative greedy decode on llama.cpp and llama.cpp's own greedy AR part ways (both are the file's
model, computed by different ggml kernels: ggml quantizes activations for quantized matmuls, and batched kernels sum
in another order).

Writes ``<out>/llamacpp_width.json`` and ``<out>/README.md`` (with ``lscpu``'s model and AVX flags).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llamacpp_backend import FTYPES, SUITES, requantized  # noqa: E402

from toolkit.cpu import cpu_isa, cpu_line  # noqa: E402
from toolkit.engine.cost import measure_verify_cost  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import spread  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402

SETTINGS = {"f16 KV": ("f16", "f16"), "q8_0 KV": ("q8_0", "q8_0")}  # both with flash attention (cache_kwargs)


def prefilled(forward, cache, prompt: list[int]) -> torch.Tensor:
    """A new sequence on ``cache`` holding ``prompt``; logits ``(vocab,)`` of its last position."""
    cache.keep_rows([])
    row, kwargs = cache.begin_row(len(prompt))
    logits = forward.prefill(torch.tensor([prompt]), kwargs)
    cache.add_row(row, len(prompt))
    return logits


def score(forward, cache, prompt: list[int], tokens: int, widths: list[int]) -> dict:
    """Reference logits (one token per forward) and, per width, the differences (see the module docstring)."""
    last = int(prefilled(forward, cache, prompt).argmax())
    fed, reference = [], []
    for _ in range(tokens):
        fed.append(last)
        logits = forward(cache, torch.tensor([[last]]))[0, 0]
        cache.accept(None, [1])
        reference.append(logits)
        last = int(logits.argmax())
    reference = torch.stack(reference)
    top2 = reference.topk(2, -1).values
    out = {}
    for width in widths:
        prefilled(forward, cache, prompt)
        wide = []
        for start in range(0, tokens, width):
            chunk = fed[start:start + width]
            wide.append(forward(cache, torch.tensor([chunk]))[0])
            cache.accept(None, [len(chunk)])
        wide = torch.cat(wide)
        flips = (wide.argmax(-1) != reference.argmax(-1)).nonzero().flatten().tolist()
        out[width] = {"max_abs_diff": (wide - reference).abs().amax(-1).tolist(), "flips": flips,
                      "flip_margins": [float(top2[i, 0] - top2[i, 1]) for i in flips],
                      "positions": [len(prompt) + 1 + i for i in range(tokens)]}  # cached when the logits come
    cache.keep_rows([])
    return out


def measure_file(source: str, prompts, args) -> dict:
    """Every setting and width on one GGUF file (``embedded`` or a path)."""
    from transformers import AutoTokenizer

    from toolkit.engine.llamacpp_forward import LlamaCppForward
    from toolkit.kv.ggml_types import GgmlTypes
    from toolkit.models.llamacpp import LlamaCppTarget, metadata_dir
    from toolkit.requests import encode

    gguf, meta = metadata_dir(source, "--gguf")
    target, tokenizer = LlamaCppTarget(gguf, meta, threads=args.threads), AutoTokenizer.from_pretrained(meta)
    encoded = [encode(tokenizer, source, p.prompt, f"prompts.{p.id}")[0].tolist() for p in prompts]
    result = {}
    for name, (type_k, type_v) in SETTINGS.items():
        policy = None if type_k == "f16" else GgmlTypes(type_k=type_k, type_v=type_v)
        forward = LlamaCppForward(target, policy)
        cache = forward.cache_for(None, 1, 2048, max(args.widths))
        per_prompt = [score(forward, cache, ids, args.tokens, args.widths) for ids in encoded]
        curve = [round(x, 1) for x in measure_verify_cost(target, 8, forward=forward).step_ms]
        rows = {"curve_ms": curve}
        for w in args.widths:
            diffs = [d for p in per_prompt for d in p[w]["max_abs_diff"]]
            margins = [m for p in per_prompt for m in p[w]["flip_margins"]]
            at = [n for p in per_prompt for n in p[w]["positions"]]
            near = [d for d, n in zip(diffs, at) if n <= args.split]
            far = [d for d, n in zip(diffs, at) if n > args.split]
            rows[w] = {"median_max_abs_diff": statistics.median(diffs), "max_abs_diff": max(diffs),
                       "max_abs_diff_within_split": max(near, default=None),
                       "max_abs_diff_past_split": max(far, default=None), "positions_past_split": len(far),
                       "flips": sum(len(p[w]["flips"]) for p in per_prompt), "positions": len(diffs),
                       "largest_flip_margin": max(margins, default=None)}
        result[name] = rows
    return result


def markdown(report: dict) -> str:
    c = report["cpu"]
    lines = ["# Does the verify width change llama.cpp's logits?", "",
             f"CPU: {cpu_line(c)}. llama-cpp-python "
             f"{report['llama_cpp']}, {report['threads']} threads; {report['prompts']} prompts of "
             f"`{report['suite']}`, {report['tokens']} greedy tokens each, scored one per forward (llama.cpp's AR) "
             "and in forwards of W tokens (the verify); every llama.cpp context runs flash attention "
             f"(`cache_kwargs`). Split: the positions cached when a token's logits come, up to {report['split']} or past it.",
             "",
             "| file | KV | W | median max\\|Δ logit\\| | max\\|Δ logit\\| | max, <= split | max, > split "
             "(positions) | argmax changed | largest top-2 margin there |", "|---|---|---|---|---|---|---|---|---|"]
    for file, settings in report["files"].items():
        for setting, rows in settings.items():
            for w, r in rows.items():
                if w == "curve_ms":
                    continue
                margin = "–" if r["largest_flip_margin"] is None else f"{r['largest_flip_margin']:.3f}"
                near, far = (("–" if r.get(k) is None else f"{r[k]:.3f}")
                             for k in ("max_abs_diff_within_split", "max_abs_diff_past_split"))
                lines.append(f"| {file} | {setting} | {w} | {r['median_max_abs_diff']:.3f} | {r['max_abs_diff']:.3f} "
                             f"| {near} | {far} ({r.get('positions_past_split', 0)}) | {r['flips']} / "
                             f"{r['positions']} | {margin} |")
    lines += ["", "Verify cost through the same forward (ms for 1-8 tokens after 256 of context; median of 5):", "",
              "| file | KV | ms, 1-8 tokens | 2 / 1 | 4 / 1 |", "|---|---|---|---|---|"]
    for file, settings in report["files"].items():
        for setting, rows in settings.items():
            c = rows["curve_ms"]
            lines.append(f"| {file} | {setting} | {' / '.join(map(str, c))} | {c[1] / c[0]:.2f} | {c[3] / c[0]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, nargs="*", default=[])
    parser.add_argument("--requantize", nargs="*", choices=sorted(FTYPES), default=["Q4_0", "Q4_K_M"])
    parser.add_argument("--suite", default="short-heldout", choices=list(SUITES))
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--split", type=int, default=256,
                        help="report the largest difference at up to / past this many cached positions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/llamacpp-width")
    args = parser.parse_args()
    import llama_cpp

    from toolkit.models.embedded import embedded_gguf_path

    files = {embedded_gguf_path().name: "embedded"}
    files.update({p.name: str(p) for p in (*(requantized("embedded", t) for t in args.requantize), *args.gguf)})
    prompts = spread(load_suite(SUITES[args.suite]), args.num_prompts)
    report = {"cpu": cpu_isa(), "llama_cpp": llama_cpp.__version__, "threads": args.threads, "suite": args.suite,
              "prompts": len(prompts), "tokens": args.tokens, "split": args.split, "files": {}}
    for name, source in files.items():
        report["files"][name] = measure_file(source, prompts, args)
        print(f"{name}: done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "llamacpp_width.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
