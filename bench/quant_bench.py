"""Weight-quantization benchmark: every backend x precision that loads here, on the embedded model.

    PYTHONPATH=. .venv/bin/python bench/quant_bench.py [--device cpu] [--repeats 7] [--context 300] [--ppl-tokens 1024]

For each configuration (fp32, bf16, bitsandbytes int8 / NF4, torchao int8 weight-only / dynamic, torchao int4):

* speed — ms of one target forward at a ``--context``-token context: a 1-token decode step and a 5-token verify
  step (K = 4 drafts + the last committed token). The context is prefilled once into a ``DynamicCache``; every timed
  step is cropped back (``cache.crop``), so all steps see the same context. All models stay loaded and
  :func:`toolkit.measure.harness.measure` interleaves them (one warm-up step each, then ``--repeats`` repetitions in a
  rotated order; medians with min-max), so a change in the machine's load hits every configuration alike; the
  device is synchronized around each step.
* quality on held-out prose (the first ``--ppl-tokens`` tokens of the GPL-3 and Apache-2.0 license texts, one
  window each): perplexity from :func:`eval.metrics.perplexity_sliding_window` (window = stride = the text, so each
  text is one forward) and top-1 agreement with fp32 (argmax of the same forward's logits, captured by a forward
  hook) — the protocol of the quantization-quality test layer.
* weight bytes — :func:`toolkit.models.weight_bytes` (packed data + scales / zero points, exact per backend).

Writes ``bench/results/quant_bench.json`` and ``bench/results/quant_bench.md``. Timings are wall-clock on whatever
else the machine is doing: compare ratios from one run, not absolute ms across runs.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.metrics import perplexity_sliding_window  # noqa: E402
from toolkit.errors import ConfigError, ModelLoadError  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from toolkit.measure.harness import Call, Prompt, measure  # noqa: E402
from toolkit.models import load_model, weight_bytes  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec  # noqa: E402
from toolkit.speculative.stats import GenerationStats  # noqa: E402

TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
# (label, ModelSpec fields): fp32 first, it is the reference for agreement.
CONFIGS = (
    ("fp32", {"precision": "fp32"}),
    ("bf16", {"precision": "bf16"}),
    ("bitsandbytes int8 (LLM.int8)", {"precision": "int8", "backend": "bitsandbytes"}),
    ("bitsandbytes int4 (NF4)", {"precision": "int4", "backend": "bitsandbytes"}),
    ("torchao int8 weight-only", {"precision": "int8", "backend": "torchao", "torchao_int8": "weight_only"}),
    ("torchao int8 dynamic act.", {"precision": "int8", "backend": "torchao", "torchao_int8": "dynamic"}),
    ("torchao int8 dynamic act., bf16", {"precision": "int8", "backend": "torchao", "torchao_int8": "dynamic",
                                         "torchao_compute_dtype": "bf16"}),
    ("torchao int4 (group 32, bf16)", {"precision": "int4", "backend": "torchao", "torchao_group_size": 32}),
    ("torchao int4 (group 64, bf16)", {"precision": "int4", "backend": "torchao", "torchao_group_size": 64}),
)


def held_out_windows(tokenizer, tokens: int) -> list[list[int]]:
    """The first ``tokens`` token ids of each held-out text (the quality layer's protocol)."""
    out = []
    for path in TEXTS:
        ids = tokenizer(Path(path).read_text()).input_ids[:tokens]
        if len(ids) < tokens:
            raise ValueError(f"{path} has only {len(ids)} tokens, --ppl-tokens asks for {tokens}")
        out.append(ids)
    return out


def quality(model, windows: list[list[int]]) -> dict:
    """Perplexity (:func:`eval.metrics.perplexity_sliding_window`, one window per text) and the top-1 predictions
    of the same forwards, ``(sum(len) - len(windows),)`` token ids."""
    predictions: list[torch.Tensor] = []

    def keep_argmax(module, args, output):
        predictions.append(output.logits[0, :-1].float().argmax(-1).cpu())

    handle = model.register_forward_hook(keep_argmax)
    try:
        results = [perplexity_sliding_window(model, ids, window=len(ids), stride=len(ids)) for ids in windows]
    finally:
        handle.remove()
    nll = sum(r["nll_sum"] for r in results)
    count = sum(r["tokens"] for r in results)
    return {"ppl": float(torch.tensor(nll / count).exp()), "predicted_tokens": count,
            "predictions": torch.cat(predictions)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """A model with ``len(context_ids) - 5`` tokens prefilled into a ``DynamicCache``; :meth:`step` times one
    forward of 1 (decode) or 5 (verify) tokens on that context and crops the cache back (``cache.crop``)."""

    @torch.inference_mode()
    def __init__(self, model, context_ids: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.ids = torch.tensor([context_ids], device=self.device)
        self.context = self.ids.shape[1] - 5
        self.cache = DynamicCache(config=model.config)
        model(input_ids=self.ids[:, :self.context], past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def step(self, width: int) -> float:
        """Milliseconds of one forward of ``width`` new tokens (device synchronized before and after)."""
        positions = torch.arange(self.context, self.context + width, device=self.device).unsqueeze(0)
        _sync(self.device)
        start = time.perf_counter()
        self.model(input_ids=self.ids[:, self.context:self.context + width], past_key_values=self.cache,
                   position_ids=positions, use_cache=True)
        _sync(self.device)
        elapsed = (time.perf_counter() - start) * 1000
        self.cache.crop(-width)
        return elapsed


def interleaved_step_times(timers: dict[str, StepTimer], repeats: int) -> dict:
    """Per label, median (min-max) ms of decode (1 token) and verify (5 tokens) steps, timed by
    :func:`toolkit.measure.harness.measure`: one warm-up step each, then ``repeats`` repetitions that time every (model,
    width) once, in an order rotated between repetitions, so a change in machine load hits every model alike."""

    def step_runner(timer: StepTimer, width: int):
        return lambda _ids, _gen: Call([], GenerationStats(new_tokens=width, total_ms=timer.step(width)))

    runners = {(label, name): step_runner(timer, width) for label, timer in timers.items()
               for name, width in (("decode", 1), ("verify5", 5))}
    context = Prompt("context", "prose", torch.zeros(1, 1, dtype=torch.long))  # each timer holds its own context
    m = measure(runners, [context], GenerationSpec(max_new_tokens=1), repeats=repeats, warmup=1, rotate=True,
                desc="decode/verify steps")
    out: dict = {label: {} for label in timers}
    for (label, name) in runners:
        v = [rep[0].stats.total_ms for rep in m.calls[(label, name)]]
        out[label][name] = {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
    return out


def run(args) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    rows, skipped, reference, timers = [], [], None, {}
    for label, fields in CONFIGS:
        spec = ModelSpec(source="embedded", device=args.device, **fields)
        try:
            model, tokenizer = load_model(spec, "target")
        except (ConfigError, ModelLoadError) as exc:
            skipped.append({"config": label, "reason": str(exc)})
            print(f"[skip] {label}: {exc}", flush=True)
            continue
        windows = held_out_windows(tokenizer, args.ppl_tokens)
        q = quality(model, windows)
        if reference is None:
            reference = q
        rows.append({
            "config": label, "spec": fields, "backend": model.toolkit_backend,
            "top1_agreement": float((q["predictions"] == reference["predictions"]).float().mean()),
            "ppl": q["ppl"], "ppl_ratio": q["ppl"] / reference["ppl"], "weight_bytes": weight_bytes(model),
        })
        timers[label] = StepTimer(model, windows[0][: args.context + 5])
        print(f"{label}: top-1 {rows[-1]['top1_agreement']:.3f}, PPL {q['ppl']:.2f}, "
              f"{rows[-1]['weight_bytes'] / 2**20:.1f} MiB", flush=True)
    speed = interleaved_step_times(timers, args.repeats)
    for row in rows:
        row["decode_ms"], row["verify5_ms"] = speed[row["config"]]["decode"], speed[row["config"]]["verify5"]
    return {
        "rows": rows, "skipped": skipped,
        "setup": {"device": args.device, "context_tokens": args.context, "repeats": args.repeats,
                  "timing": "interleaved rounds, all models loaded at once",
                  "ppl_texts": list(TEXTS), "ppl_tokens_per_text": args.ppl_tokens,
                  "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor()
                  or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "versions": _versions()},
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "torchao", "bitsandbytes", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def markdown(result: dict) -> str:
    setup = result["setup"]
    lines = [
        "# Weight quantization: speed and quality per backend",
        "",
        f"Embedded SmolLM2-135M-Instruct on `{setup['device']}` ({setup['cpu_capability']}, {setup['threads']} "
        f"thread(s)); {setup['context_tokens']}-token context; medians (min-max) over {setup['repeats']} steps; "
        f"PPL and top-1 agreement with fp32 on {len(setup['ppl_texts'])} x {setup['ppl_tokens_per_text']} tokens "
        f"of held-out license text. Versions: {setup['versions']}.",
        "",
        "| weights | backend | decode 1 tok (ms) | verify 5 (ms) | top-1 agreement | PPL | PPL / fp32 | weight MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        d, v = r["decode_ms"], r["verify5_ms"]
        lines.append(
            f"| {r['config']} | {r['backend']} | {d['median_ms']:.1f} ({d['min_ms']:.1f}-{d['max_ms']:.1f}) | "
            f"{v['median_ms']:.1f} ({v['min_ms']:.1f}-{v['max_ms']:.1f}) | {r['top1_agreement']:.3f} | "
            f"{r['ppl']:.2f} | {r['ppl_ratio']:.4f} | {r['weight_bytes'] / 2**20:.1f} |")
    for s in result["skipped"]:
        lines.append(f"\n- skipped {s['config']}: {s['reason']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    result = run(args)
    stem = "quant_bench" if args.device == "cpu" else f"quant_bench_{args.device}"
    atomic_write_json(args.out / f"{stem}.json", result)
    atomic_write_text(args.out / f"{stem}.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
