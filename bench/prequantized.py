"""A checkpoint already quantized by torchao or bitsandbytes, run on its own weights (``precision: native``) against
the toolkit's own re-quantization of the same model, one run.

    make bench-prequantized
    PYTHONPATH=. .venv/bin/python bench/prequantized.py [--formats torchao-int4 bnb-nf4 ...] [--stages quality speed]

The checkpoints are the embedded SmolLM2-135M (fp32, transformers' dequantized copy of its GGUF) quantized and saved
by transformers itself (``quantization_config=TorchAoConfig / BitsAndBytesConfig``, ``save_pretrained``; cached under
``--work``), in the formats these versions can make on a CPU: torchao int4 weight-only (``IntxWeightOnlyConfig``,
group 32, asymmetric), torchao int8 weight-only, bitsandbytes NF4 (double quantization), LLM.int8().

* ``quality`` — teacher-forced on 1,024 held-out tokens of prose and of code: perplexity and top-1 agreement with fp32
  of ``native`` (the checkpoint) and of the toolkit's re-quantization of the fp32 model at the same precision and
  backend (what a user would run without the checkpoint); and whether native greedy (64 tokens) equals transformers'
  own ``from_pretrained`` of the checkpoint.
* ``speed`` — the main recipe (``recipes/short.yaml``, ``compile: auto``) on ``native`` checkpoint weights against the
  same recipe on the re-quantized fp32 model, interleaved per prompt, 4 ``make short`` prompts, 96 new tokens,
  median of 3.

Writes ``<out>/prequantized.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.native_gguf import _agree, _nll_argmax, cpu  # noqa: E402
from eval.data import heldout_ids  # noqa: E402
from toolkit.io import atomic_write_json  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.models.embedded import resolve_source  # noqa: E402
from toolkit.recipe import ModelSpec  # noqa: E402

#: format -> (the toolkit's own re-quantization of the fp32 model that it stands against: ModelSpec fields)
FORMATS = {"torchao-int4": {"precision": "int4", "backend": "torchao", "torchao_group_size": 32},
           "torchao-int8": {"precision": "int8", "backend": "torchao", "torchao_int8": "weight_only"},
           "bnb-nf4": {"precision": "int4", "backend": "bitsandbytes"},
           "bnb-int8": {"precision": "int8", "backend": "bitsandbytes"}}


def quantization_config(name: str):
    import torchao.quantization as q
    from transformers import BitsAndBytesConfig, TorchAoConfig

    # asymmetric int4 groups of 32, as the toolkit's torchao int4 (a symmetric checkpoint scores worse: its format)
    return {"torchao-int4": lambda: TorchAoConfig(q.IntxWeightOnlyConfig(
                weight_dtype=torch.int4, granularity=q.PerGroup(32), mapping_type=q.MappingType.ASYMMETRIC)),
            "torchao-int8": lambda: TorchAoConfig(q.Int8WeightOnlyConfig()),
            "bnb-nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32),
            "bnb-int8": lambda: BitsAndBytesConfig(load_in_8bit=True)}[name]()


def checkpoint(name: str, work: Path) -> str:
    """The embedded model quantized as ``name`` and saved by transformers (made once under ``work``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / f"smollm2-{name}"
    if not (out / "config.json").is_file():
        fp32 = resolve_source("embedded", "source", torch.float32)
        model = AutoModelForCausalLM.from_pretrained(fp32, quantization_config=quantization_config(name),
                                                     device_map="cpu", dtype=torch.float32)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(fp32).save_pretrained(out)
    return str(out)


def stage_quality(args, report: dict) -> None:
    from transformers import AutoModelForCausalLM

    fp32, tokenizer = load_model(ModelSpec(source="embedded", precision="fp32", device="cpu"))
    texts = {text: heldout_ids(tokenizer, text, args.tokens) for text in ("prose", "code")}
    reference = {text: _nll_argmax(fp32, ids)[1] for text, ids in texts.items()}
    out = {}
    for name in args.formats:
        directory = checkpoint(name, Path(args.work))
        models = {"native (checkpoint)": load_model(ModelSpec(source=directory, precision="native", device="cpu"))[0],
                  "re-quantized fp32": load_model(ModelSpec(source="embedded", device="cpu", **FORMATS[name]))[0]}
        out[name] = {"weights": models["native (checkpoint)"].toolkit_weights}
        for label, model in models.items():
            for text, ids in texts.items():
                nll, argmax = _nll_argmax(model, ids)
                out[name][f"{label} {text}"] = {"ppl": math.exp(sum(nll) / len(nll)),
                                                "top1_vs_fp32": _agree(argmax, reference[text])}
        prompt = torch.tensor([texts["prose"][:32]])
        hf = AutoModelForCausalLM.from_pretrained(directory, device_map="cpu").eval()
        with torch.no_grad():
            ours = models["native (checkpoint)"].generate(prompt, do_sample=False, max_new_tokens=64)
            theirs = hf.generate(prompt, do_sample=False, max_new_tokens=64)
        out[name]["greedy_equals_transformers"] = torch.equal(ours, theirs)
        print(json.dumps({name: out[name]}), file=sys.stderr)
    report["quality"] = out


def stage_speed(args, report: dict) -> None:
    """The main recipe on each checkpoint's native weights vs the re-quantized fp32 model, interleaved per prompt."""
    import dataclasses

    from eval.runners import ours_runner
    from toolkit.measure.harness import Prompt, measure, spread
    from toolkit.measure.prompts import load_suite
    from toolkit.recipe import GenerationSpec, Recipe
    from toolkit.resources import resolve
    from toolkit.speculative_lm import build

    recipe = Recipe.load(resolve("short", "", "recipe"))
    out = {"cpu": cpu()}
    gen = GenerationSpec(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for name in args.formats:
        native = recipe.with_target(checkpoint(name, Path(args.work)))
        fp32 = resolve_source("embedded", "source", torch.float32)
        requantized = recipe.replace(target=dataclasses.replace(recipe.target, source=fp32, **FORMATS[name]))
        generators = {"native": build(native), "re-quantized": build(requantized)}
        items = [Prompt(p.id, p.kind, generators["native"].encode(p.prompt, p.id))
                 for p in spread(load_suite("short"), 4)]
        longest = max(int(i.input_ids.shape[1]) for i in items) + gen.max_new_tokens
        compile_s = {n: round(g.warm_up(longest), 1) for n, g in generators.items()}
        eos = generators["native"].eos_token_ids(gen)
        measured = measure({n: ours_runner(g, eos) for n, g in generators.items()}, items, gen, repeats=args.repeats,
                           warmup=1, desc=f"speed {name}",
                           before_repetition=lambda rep: [g.forget() for g in generators.values()])
        out[name] = {"tok_s": {n: measured.speed(n)["throughput"] for n in generators},
                     "ratio_native_vs_requantized": measured.paired_ratio("native", "re-quantized"),
                     "paths": {n: g.engine_note for n, g in generators.items()}, "compile_s": compile_s}
        print(json.dumps({name: out[name]}), file=sys.stderr)
    report["speed"] = out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--stages", nargs="+", default=["quality", "speed"], choices=["quality", "speed"])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=str(ROOT / "results/prequantized-work"))
    parser.add_argument("--out", default=str(ROOT / "bench/reports/prequantized"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    report: dict = {"formats": args.formats}
    out = Path(args.out)
    for stage in args.stages:
        {"quality": stage_quality, "speed": stage_speed}[stage](args, report)
        atomic_write_json(out / "prequantized.json", report)


if __name__ == "__main__":
    main()
