"""The GPU benchmark kit: every GPU stage in one command, each stage on its own (a failure is recorded and the next
stage runs), at most 3 files written, a summary table printed last.

    PYTHONPATH=. python bench/gpu_bench.py --out DIR            # on a lent GPU (make bench-gpu), <= 8 minutes
    PYTHONPATH=. python bench/gpu_bench.py --dry-run --out DIR  # the same stages on the CPU with tiny models

It needs only torch and transformers (plus what they import); torchao, bitsandbytes and gguf are used when installed
or carried as wheels in ``.gpu-carry/wheels`` (``bench/gpu_carry.py`` prepares that folder here), and skipped with one
line otherwise. Models are random-weight models of real shapes built on the device from configs (no hub); the real
embedded model joins when its GGUF was relayed in parts (``bench/README.md``). Stages:

1. ``environment`` — versions, device, which carried packages loaded;
2. ``greedy`` — every decoding path (AR, lookup, draft model, EAGLE head, tree, a batch of 8) token-identical to HF
   greedy ``generate`` on the same fp32 weights (and the real embedded model when relayed);
3. ``verify_cost`` — ms of a forward over 1..64 new tokens at B = 1 and 8 on a 1B shape;
4. ``speed`` — tok/s of HF AR, HF static-cache compiled AR, HF assisted, HF prompt lookup and ours with each drafter,
   peak device memory, alpha / tau and the per-round split (host overhead);
5. ``speed_real`` — the real embedded model (relayed GGUF) on the repeated-request suite: HF static-cache compiled
   AR and prompt lookup against our AR and lookup on the compiled engine (real acceptance);
6. ``sampling`` — a chi-square test that speculative sampling (a draft model sampling 3 tokens) reproduces the
   target distribution;
7. ``kv`` — each KV policy's greedy tokens on the device equal the same policy on the CPU;
8. ``projection`` — speedups projected from CPU-measured acceptance (real weights) and this device's verify curve;
9. ``verify_cost_more`` — more verify curves (B = 32, a 0.5B and an 8B shape) in the time left.

By default stages run in that order (the targets first); ``--stages`` picks some and runs them in the order given.
The JSON and Markdown are rewritten after every stage and inside the long ones, so a run stopped from outside keeps
what it measured.

Writes ``DIR/gpu_bench.json`` (everything), ``DIR/gpu_bench.md`` (the tables) and ``DIR/gpu_bench.log``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from gpu_kit import carry  # noqa: E402
from gpu_kit.context import StageSkipped  # noqa: E402

#: in priority order: what the GPU issue's targets need first, the rest in the time left
STAGES = ("environment", "greedy", "verify_cost", "speed", "speed_real", "sampling", "kv", "projection",
          "verify_cost_more")
#: the second edition's stages (bench/README.md): not in the default run, named with --stages (or --stages new)
NEW_STAGES = ("accept_identity", "width_probe", "kivi_device", "weights", "kv_long", "drafters_real", "compositions",
              "eagle_train", "search")
#: --stages shorthands: ``new`` = every second-edition stage in priority order, ``all`` = both editions
GROUPS = {"new": NEW_STAGES, "all": STAGES + NEW_STAGES}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_bench.{json,md,log}")
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU with tiny models")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: cuda when available (the dry run always uses the CPU)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the speed stages")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=[*STAGES, *NEW_STAGES, *GROUPS],
                        metavar="STAGE",
                        help=f"stages to run, in the order given (default: the first edition's {', '.join(STAGES)}; "
                             f"the second edition's: {', '.join(NEW_STAGES)}; 'new' = all of those, 'all' = both; "
                             "speed and projection read the curve of a verify_cost that ran before them)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds after which remaining work is skipped and said so (default 450)")
    parser.add_argument("--stage-s", nargs="+", default=[], metavar="STAGE=SECONDS",
                        help="a cap per stage: after SECONDS of its own it starts no more rows (e.g. weights=150), "
                             "so that one stage cannot spend the whole budget")
    parser.add_argument("--carry", type=Path, default=ROOT / ".gpu-carry",
                        help="carried wheels / tokenizer / GGUF parts (default .gpu-carry)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of HF's compiled AR: inductor (default), eager (the dry run's "
                             "default: no code generation), none (skip)")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode (default: reduce-overhead on CUDA, i.e. CUDA graphs; none on CPU)")
    args = parser.parse_args(argv)
    args.stages = [name for item in args.stages for name in GROUPS.get(item, (item,))]
    if args.budget_s <= 0:
        parser.error(f"--budget-s: must be > 0, got {args.budget_s}")
    args.stage_caps = {}
    for item in args.stage_s:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in (*STAGES, *NEW_STAGES) or value <= 0:
            parser.error(f"--stage-s: expected STAGE=SECONDS with STAGE one of {', '.join((*STAGES, *NEW_STAGES))} "
                         f"and SECONDS > 0, got {item!r}")
        args.stage_caps[name] = value
    return args


def make_kit(args, log):
    from gpu_kit.context import Kit

    if args.dry_run or args.device == "cpu":
        device = torch.device("cpu")
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu or --dry-run)")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    mode = args.compile_mode or ("reduce-overhead" if device.type == "cuda" and backend == "inductor" else None)
    dtype = DTYPES[args.dtype]
    return Kit(device=device, dtype=dtype, dry_run=args.dry_run, carry_dir=args.carry, budget_s=args.budget_s,
               compile_backend=backend, compile_mode=None if mode == "none" else mode, log=log, out_dir=args.out,
               args={k: str(v) for k, v in vars(args).items()}, stage_caps=dict(args.stage_caps))


def environment(kit, wheels: dict) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(kit.device), "dtype": str(kit.dtype), "dry_run": kit.dry_run, "packages": wheels,
           "tokenizer": "embedded SmolLM2" if kit.tokenizer is not None else "none (token-id prompts)",
           "compile": {"backend": kit.compile_backend, "mode": kit.compile_mode},
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    env["imports"] = _imports(wheels)
    env["versions"] = {d: carry._version(d) for d in ("pyarrow", "fsspec", "huggingface_hub", "numpy", "triton")}
    if kit.device.type == "cuda":
        props = torch.cuda.get_device_properties(kit.device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   capability=list(torch.cuda.get_device_capability()))
    else:
        env.update(gpu=None, cpu_count=torch.get_num_threads(), machine=platform.machine())
    return env


def _imports(wheels: dict) -> dict:
    """``{name: "ok" | "ImportError: ..."}`` for each optional package that is installed or carried: a version
    mismatch with the machine's packages shows here, before a stage needs it."""
    import importlib

    out = {}
    for name, state in wheels.items():
        if state.startswith("missing"):
            continue
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, the stages that need it fail with their own error
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def run_stage(kit, name: str, fn) -> None:
    """Run one stage; store ``{"status", "seconds", "result" | "error"}`` in ``kit.results[name]``."""
    kit.log(f"== stage {name}")
    kit.results.pop(name, None)
    began = time.perf_counter()
    kit.begin_stage(name)
    if kit.out_of_time(f"stage {name}"):
        kit.results[name] = {"status": "skipped", "seconds": 0.0, "error": "time budget spent"}
        return
    try:
        result = fn()
        kit.results[name] = {"status": "ok", "seconds": time.perf_counter() - began, "result": result}
    except StageSkipped as exc:  # the stage cannot run here (e.g. it needs CUDA): said, not failed
        kit.results[name] = {"status": "skipped", "seconds": time.perf_counter() - began, "error": str(exc)}
        partial = kit_partial_result(kit, name)
        if partial is not None:
            kit.results[name]["result"] = partial
    except Exception as exc:  # noqa: BLE001 - a failing stage is recorded, the next one runs
        kit.log(traceback.format_exc())
        kit.results[name] = {"status": "failed", "seconds": time.perf_counter() - began,
                             "error": f"{type(exc).__name__}: {exc}"[:1000]}
        partial = kit_partial_result(kit, name)
        if partial is not None:  # what the stage measured before it failed
            kit.results[name]["result"] = partial
    finally:
        if kit.device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a broken context must not lose the results so far
                kit.log(f"CUDA synchronize after {name} failed: {type(exc).__name__}: {exc}")
    kit.log(f"   {name}: {kit.results[name]['status']} in {kit.results[name]['seconds']:.1f} s")


def kit_partial_result(kit, name: str):
    """The results a stage saved with :meth:`Kit.partial` before it failed (``None`` if none)."""
    saved = kit.results.get(name, {})
    return saved.get("result") if saved.get("status") == "running" else None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logger = _logger(args.out / "gpu_bench.log")
    wheels = carry.load_wheels(args.carry / "wheels", log=logger.info)
    from gpu_kit import checks, real, second, speed
    from gpu_kit.report import summary

    kit = make_kit(args, logger.info)
    stages = {"environment": lambda: environment(kit, wheels), "greedy": lambda: checks.greedy_identity(kit),
              "sampling": lambda: checks.sampling(kit), "kv": lambda: checks.kv_policies(kit),
              "verify_cost": lambda: speed.verify_cost(kit), "speed": lambda: speed.speed(kit),
              "projection": lambda: speed.projection(kit, ROOT),
              "speed_real": lambda: real.speed_real(kit), "verify_cost_more": lambda: speed.verify_cost_more(kit),
              **second.stages(kit)}
    for name in dict.fromkeys(args.stages):  # the order given (a budget spent skips the later ones), each once
        run_stage(kit, name, stages[name])
        kit.save()  # after every stage: a run stopped from outside keeps what it measured
    print(summary(kit.results), flush=True)
    return 0 if all(r["status"] != "failed" for r in kit.results.values()) else 1


def _logger(path: Path) -> logging.Logger:
    logger = logging.getLogger("gpu_bench")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(path, mode="w")):
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    return logger


if __name__ == "__main__":
    sys.exit(main())
