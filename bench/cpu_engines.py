"""The main job against the engines a CPU user would pick instead, on the same prompts, threads and model, one run.

    make bench-cpu-engines        # installs llama.cpp + OpenVINO into .venv-engines first (a few minutes, once)
    PYTHONPATH=. .venv/bin/python bench/cpu_engines.py [--recipe short] [--suites short short-heldout unseen]
        [--num-prompts 4] [--max-new-tokens 96] [--repeats 3] [--out bench/reports/cpu-engines]

Speed: per suite, ``toolkit run --compare`` (:func:`eval.run.run_recipe`) — our decoder, HF eager AR, HF static-cache
+ compiled AR and HF prompt lookup (K 4 / 10) on the recipe's own int4 weights; llama.cpp AR and llama.cpp prompt
lookup (10 tokens, n-gram 3) on the GGUF the embedded model comes from; OpenVINO int4 AR (NNCF, groups of 32) via
optimum-intel; fp32 HF AR for reference. One warm-up call per method (HF's compile happens there and is timed
apart below), then ``--repeats`` repetitions, methods interleaved per prompt, the same thread count everywhere.

Quality (teacher-forced, no generation): perplexity and top-1 agreement with fp32 on held-out prose and code
(``eval.data.heldout_ids``), for the int4 target, the GGUF under llama.cpp and the OpenVINO export.

Also per suite: our own AR path (the recipe with no drafter, same engine: ``ours AR``), timed right after the
suite's interleaved run (not interleaved with it); and on the first suite HF ``model.generate`` with this toolkit as
``custom_generate`` (``toolkit.hf.speculative``, the recipe's drafter and engine) against plain HF eager
``generate``, interleaved, on the same model object (the lookup drafter's memory across requests off: the
repetitions ask the same prompts again).

Bytes per token: the weight bytes each engine reads per decoded token (its model file; ours: the loaded weights).

Writes ``<out>/cpu_engines.json``, ``<out>/README.md`` and ``<out>/cpu_engines.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.data import heldout_ids  # noqa: E402
from eval.run import run_recipe  # noqa: E402
from eval.runners import engine_model  # noqa: E402
from toolkit.io import atomic_write_json, atomic_write_png, atomic_write_text  # noqa: E402
from toolkit.measure import engines  # noqa: E402
from toolkit.measure.baselines import hf_generate  # noqa: E402
from toolkit.measure.harness import environment  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import Recipe  # noqa: E402
from toolkit.resources import resolve  # noqa: E402
from toolkit.session import SHARED_POOL  # noqa: E402
from toolkit.speculative_lm import build  # noqa: E402

SUITES = {"short": "short", "short-heldout": "short-heldout", "unseen": str(ROOT / "bench/prompts/unseen.yaml")}
COLUMNS = {"ours": "ours", "ar": "HF AR", "ar_static": "HF static+compile AR", "prompt_lookup": "HF PL K=4",
           "prompt_lookup_10": "HF PL K=10", "llamacpp_ar": "llama.cpp AR", "llamacpp_lookup": "llama.cpp PL 10",
           "openvino_ar": "OpenVINO int4 AR", "ar_fp32": "fp32 HF AR"}


def ours_ar(recipe: Recipe, suite: str, num_prompts: int, repeats: int) -> dict:
    """Our AR path: the recipe without a drafter (same weights, same engine), run alone."""
    from toolkit.recipe import SpeculationSpec

    ar = dataclasses.replace(recipe, name=f"{recipe.name}-ar",
                             spec=SpeculationSpec(drafter="none", adaptive="constant"))
    result = run_recipe(ar, compare=False, repeats=repeats, prompts=load_suite(SUITES[suite]),
                        num_prompts=num_prompts).to_dict()
    return {"throughput": result["summary"]["ours"]["throughput"],
            "per_prompt": {r["prompt"]: r["throughput"]["median"] for r in result["rows"]}}


def through_hf_generate(generator, recipe: Recipe, suite: str, num_prompts: int, repeats: int) -> dict:
    """tok/s of ``model.generate(custom_generate=toolkit.hf.speculative(...))`` vs plain eager ``generate``."""
    import toolkit.hf
    from toolkit.measure.harness import spread

    spec = recipe.spec
    # no memory across requests: the callable keeps what it learned per model object, and the repetitions ask the
    # same prompts again (toolkit run forgets between repetitions; here the memory is off instead)
    custom = toolkit.hf.speculative(spec.drafter, num_draft_tokens=spec.num_draft_tokens, adaptive=spec.adaptive,
                                    compile=recipe.compile, max_match=spec.max_match, max_cached_requests=0)
    model, n = generator.target, recipe.generation.max_new_tokens
    prompts = [generator.encode(p.prompt) for p in spread(load_suite(SUITES[suite]), num_prompts)]
    kwargs = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    times = {"hf_eager": [], "custom_generate": []}
    for rep in range(repeats + 1):  # repetition 0 warms up (and compiles)
        for ids in prompts:
            for name, extra in (("hf_eager", {}), ("custom_generate", {"custom_generate": custom})):
                start = time.perf_counter()
                if name == "custom_generate":  # min_new_tokens is refused there: EOS off instead
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                         eos_token_id=[], pad_token_id=0, **extra)
                else:
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=[],
                                         pad_token_id=0, **kwargs)
                if rep:
                    times[name].append((out.shape[1] - ids.shape[1], time.perf_counter() - start))
    rate = {k: sum(t for t, _ in v) / sum(s for _, s in v) for k, v in times.items()}
    return {"tok_s": rate, "ratio": rate["custom_generate"] / rate["hf_eager"]}


def first_compile_s(generator, recipe: Recipe, prompt_len: int) -> dict:
    """Seconds of HF static AR's first call (compiles) and of a second identical one (warm), 16 tokens."""
    gen = dataclasses.replace(recipe.generation, max_new_tokens=16, ignore_eos=True)
    ids = torch.full((1, prompt_len), 42)
    out = {}
    for key in ("first_call_s", "warm_call_s"):
        start = time.perf_counter()
        hf_generate(generator.target, ids, gen, [], method="ar_static", max_cache_len=512)
        out[key] = time.perf_counter() - start
    return out


def _nll_argmax(model, ids: list[int]) -> tuple[list[float], list[int]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).view(-1, 1))[:, 0]
    return nll.tolist(), logp.argmax(-1).tolist()


def quality(generator, recipe: Recipe, methods: list[str], num_tokens: int) -> dict:
    """``{source: {engine: {"ppl", "top1_vs_fp32"}}}`` over ``num_tokens`` held-out tokens per source."""
    reference, _ = SHARED_POOL.get(dataclasses.replace(recipe.target, precision="fp32"), "reference")
    out = {}
    for source in ("prose", "code"):
        ids = heldout_ids(generator.tokenizer, source, num_tokens)
        scored = {"fp32 HF": _nll_argmax(reference, ids), f"{recipe.target.precision} ours": _nll_argmax(
            generator.target, ids)}
        for method in methods:
            with engines.EngineProcess(engines.ENGINES[method], engine_model(recipe, method)) as worker:
                reply = worker.request("score", input_ids=ids)
            scored[COLUMNS[method]] = (reply["nll"], reply["argmax"])
        top1 = scored["fp32 HF"][1]
        out[source] = {name: {"ppl": math.exp(sum(nll) / len(nll)),
                              "top1_vs_fp32": sum(a == b for a, b in zip(arg, top1)) / len(top1)}
                       for name, (nll, arg) in scored.items()}
    return out


VERIFY_WIDTHS = [1, 2, 3, 4, 5, 8, 12, 16, 17]


def verify_curves(generator, recipe: Recipe, methods: list[str]) -> dict:
    """llama.cpp as a verify engine (ms of one forward over n tokens after 256 of context, exact rollback checked)
    next to our compiled engine's and our eager curves (``toolkit.speculative.cost_model``, as toolkit run uses)."""
    from toolkit.engine.cost import load_or_measure

    ids = heldout_ids(generator.tokenizer, "prose", 256 + max(VERIFY_WIDTHS))
    out = {"ours eager": load_or_measure(generator.target, max(VERIFY_WIDTHS)).step_ms}
    if generator.engine.compiled:
        out["ours compiled"] = generator.verify_cost_for(max(VERIFY_WIDTHS)).step_ms
    out = {k: {str(n): v[n - 1] for n in VERIFY_WIDTHS if n <= len(v)} for k, v in out.items()}
    if "llamacpp_ar" in methods:
        with engines.EngineProcess(engines.ENGINES["llamacpp_ar"], engine_model(recipe, "llamacpp_ar")) as worker:
            reply = worker.request("verify_curve", input_ids=ids[:256], widths=VERIFY_WIDTHS, repeats=7)
        out["llama.cpp"], out["llama.cpp rollback exact"] = reply["ms"], reply["rollback_exact"]
    return out


def weight_bytes(generator, recipe: Recipe, methods: list[str]) -> dict:
    from toolkit.models.sizes import bytes_read_per_token

    out = {"ours": bytes_read_per_token(generator.target)}
    for method in methods:
        if method != "llamacpp_lookup":  # the same file as llamacpp_ar
            with engines.EngineProcess(engines.ENGINES[method], engine_model(recipe, method)) as worker:
                out[method] = worker.request("info")
    return out


def suite_table(suite: str, result: dict) -> list[str]:
    methods = [m for m in COLUMNS if m in result["summary"]]
    by_prompt: dict[str, dict] = {}
    for row in result["rows"]:
        by_prompt.setdefault(row["prompt"], {})[row["method"]] = row["throughput"]["median"]
    ar = result.get("ours_ar", {})
    lines = [f"### {suite}", "", "| prompt | " + " | ".join(COLUMNS[m] for m in methods) + " | ours AR | ours / HF "
             "static | ours / llama.cpp AR | ours AR / HF static | ours AR / llama.cpp AR |",
             "|---" * (len(methods) + 6) + "|"]
    everything = {m: result["summary"][m]["throughput"] for m in methods}
    for prompt, tps in list(by_prompt.items()) + [("**all**", everything)]:
        tps = {**tps, "ours_ar": ar.get("per_prompt", {}).get(prompt) if prompt != "**all**" else ar.get("throughput")}
        ratio = [f"{tps[a] / tps[b]:.2f}×" if tps.get(a) and tps.get(b) else "-"
                 for a, b in (("ours", "ar_static"), ("ours", "llamacpp_ar"), ("ours_ar", "ar_static"),
                              ("ours_ar", "llamacpp_ar"))]
        own = f"{tps['ours_ar']:.1f}" if tps.get("ours_ar") else "-"
        lines.append(f"| {prompt} | " + " | ".join(f"{tps[m]:.1f}" for m in methods) + f" | {own} | "
                     f"{' | '.join(ratio)} |")
    return lines + [""]


def markdown(report: dict) -> str:
    env, compile_s = report["environment"], report["hf_static_compile"]
    lines = ["# The main job vs the CPU engines a user would pick instead", "",
             f"{env['hardware']} ({env['torch_threads']} threads for every engine), torch {env['torch']}, "
             f"transformers {env['transformers']}, {env['date']}. Recipe `{report['recipe']}`, "
             f"{report['max_new_tokens']} new tokens, greedy, tok/s = new tokens / wall time including the prompt, "
             f"median of {report['repeats']} interleaved repetitions. HF static+compile's first call took "
             f"{compile_s['first_call_s']:.0f} s (compile, from inductor's on-disk cache when warm), a warm one "
             f"{compile_s['warm_call_s']:.1f} s. `ours AR` = the recipe without a drafter on the same engine, one "
             "run right after the interleaved ones.", "",
             "## Speed (tok/s)", ""]
    for suite, result in report["suites"].items():
        lines += suite_table(suite, result)
    hf = report.get("hf_generate")
    if hf:
        lines += [f"Through HF `model.generate(custom_generate=toolkit.hf.speculative(...))` on the first suite: "
                  f"{hf['tok_s']['custom_generate']:.1f} tok/s vs plain HF eager `generate` "
                  f"{hf['tok_s']['hf_eager']:.1f} tok/s: **{hf['ratio']:.2f}×** (same model object, interleaved).", ""]
    lines += ["## Quality (teacher-forced, held-out text; top-1 = argmax agrees with fp32)", "",
              "| engine | " + " | ".join(f"{s} PPL | {s} top-1" for s in report["quality"]) + " |",
              "|---" * (1 + 2 * len(report["quality"])) + "|"]
    names = list(next(iter(report["quality"].values())))
    for name in names:
        cells = " | ".join(f"{q[name]['ppl']:.2f} | {q[name]['top1_vs_fp32']:.3f}" for q in report["quality"].values())
        lines.append(f"| {name} | {cells} |")
    lines += ["", "## Weight bytes read per token", ""]
    for method, info in report["weight_bytes"].items():
        size = info if isinstance(info, int) else info["weight_bytes"]
        version = "" if isinstance(info, int) else f" ({info['engine']} {info['version']})"
        lines.append(f"- {COLUMNS.get(method, method)}{version}: {size / 2**20:.1f} MiB")
    curves = {k: v for k, v in report.get("verify_curves", {}).items() if isinstance(v, dict)}
    if curves:
        lines += ["", "## Verify cost: ms of one forward over n new tokens after 256 of context", "",
                  "| n | " + " | ".join(str(n) for n in VERIFY_WIDTHS) + " |", "|---" * (1 + len(VERIFY_WIDTHS)) + "|"]
        for name, ms in curves.items():
            lines.append(f"| {name} | " + " | ".join(f"{ms[str(n)]:.1f}" if str(n) in ms else "-"
                                                   for n in VERIFY_WIDTHS) + " |")
        if "llama.cpp rollback exact" in report["verify_curves"]:
            lines += ["", f"llama.cpp rollback exact (bit-identical logits after every rollback): "
                      f"{report['verify_curves']['llama.cpp rollback exact']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(report["suites"])
    methods = [m for m in COLUMNS if all(m in r["summary"] for r in report["suites"].values())]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [report["suites"][s]["summary"][method]["throughput"] for s in suites]
        ax.bar([x + i * width for x in range(len(suites))], values, width, label=COLUMNS[method])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(suites))], suites)
    ax.set_ylabel("tok/s (all prompts)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="short")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reports/cpu-engines")
    parser.add_argument("--redo-hf-generate", action="store_true",
                        help="re-measure only the custom_generate comparison into an earlier --out report")
    args = parser.parse_args()
    if args.redo_hf_generate:
        report = json.loads((args.out / "cpu_engines.json").read_text())
        recipe = Recipe.load(resolve(report["recipe"], "", "--recipe"))
        recipe = recipe.replace(generation=dataclasses.replace(recipe.generation,
                                                               max_new_tokens=report["max_new_tokens"]))
        report["hf_generate"] = through_hf_generate(build(recipe, pool=SHARED_POOL), recipe, args.suites[0],
                                                    args.num_prompts, report["repeats"])
        atomic_write_json(args.out / "cpu_engines.json", report)
        atomic_write_text(args.out / "README.md", markdown(report))
        return
    methods = engines.available()
    if not methods:
        sys.exit("no CPU engine installed: run `make bench-cpu-engines` (scripts/install_engines.sh)")
    recipe = Recipe.load(resolve(args.recipe, "", "--recipe"))
    recipe = recipe.replace(generation=dataclasses.replace(recipe.generation, max_new_tokens=args.max_new_tokens))
    generator = build(recipe, pool=SHARED_POOL)
    report = {"recipe": args.recipe, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "engines": methods, "hf_static_compile": first_compile_s(generator, recipe, 64), "suites": {}}
    for suite in args.suites:
        result = run_recipe(recipe, compare=True, repeats=args.repeats, prompts=load_suite(SUITES[suite]),
                            generator=generator, num_prompts=args.num_prompts).to_dict()
        result["ours_ar"] = ours_ar(recipe, suite, args.num_prompts, args.repeats)
        report["suites"][suite] = result
        print("\n".join(suite_table(suite, result)), flush=True)
    report["hf_generate"] = through_hf_generate(generator, recipe, args.suites[0], args.num_prompts, args.repeats)
    report["quality"] = quality(generator, recipe, [m for m in methods if m != "llamacpp_lookup"],
                                args.quality_tokens)
    report["weight_bytes"] = weight_bytes(generator, recipe, methods)
    report["verify_curves"] = verify_curves(generator, recipe, methods)
    report["environment"] = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "cpu_engines.json", report)
    atomic_write_text(args.out / "README.md", markdown(report))
    plot(report, args.out / "cpu_engines.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
