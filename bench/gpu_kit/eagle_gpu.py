"""Stage ``eagle_train``: an EAGLE-3 head for the embedded SmolLM2-135M-Instruct, trained on the device within a set
time by the toolkit's own trainer (:func:`toolkit.distill.eagle_train.train_head`: self-distillation on the target's
own greedy answers to chat prompts built from local text, training-time test, held-out acceptance curve; the head
trains on the target's device), then measured on held-out prompts the way ``drafters_real`` measures the shipped head
(:func:`gpu_kit.drafters_real.measure_head`: tok/s against HF static-cache compiled AR, α, τ, per-round split).

Data: text files of this repository (they travel with the tree to an offline GPU machine): the toolkit's and the
evaluator's Python sources and the docs; the prompt suites of ``recipes/prompts`` are never used (the trainer
excludes their source files). The training run lives in a scratch folder; what comes back in ``--out`` is the head
(``eagle3_head/config.json`` + ``model.safetensors``, bf16) and ``eagle3_head/README.md`` with the settings, the
curve and the command that reproduces it; the curve and the summary are in the stage's JSON result too.

On the CPU (``--dry-run``, or ``--device cpu``) the stage is a rehearsal with tiny settings: the head it trains must
load through the normal recipe path (``spec.drafter: eagle``, ``draft.source`` = the head folder) and draft.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

from gpu_kit.drafters_real import measure_head, real_target

ROOT = Path(__file__).resolve().parents[2]
#: the training text: files of this repository (no prompt-suite file)
DATA = [str(ROOT / "toolkit/**/*.py"), str(ROOT / "eval/**/*.py"), str(ROOT / "docs/*.md"), str(ROOT / "README.md"),
        str(ROOT / "bench/README.md"), str(ROOT / "toolkit_cli/*.py")]
#: the GPU run's settings (minutes: the training loop; data preparation and the held-out measurement come on top)
#: (the chat answers are the data that bounds τ: 64 rows per batch gave 244 sequences in 56 s on the H100 -- HF's eager
#: ``generate`` on a 135M model is launch-bound, so 256 rows per batch should cost little more per step: not yet
#: measured -- hence 256 rows and 4x the prompts within the same 1.5 minutes)
GPU = {"variant": "eagle3", "draft_vocab": 4096, "seq_len": 320, "text_windows": 512, "chat_prompts": 2400,
       "chat_minutes": 1.5, "chat_new_tokens": 160, "chat_batch": 256, "heldout_prompts": 40, "batch_size": 16,
       "lr": 1e-3, "eval_every_minutes": 1.0, "ttt_steps": 3, "minutes": 4.0}
#: the CPU rehearsal's (seconds on a 2-core machine)
REHEARSAL = {"variant": "eagle3", "draft_vocab": 512, "seq_len": 256, "text_windows": 6, "chat_prompts": 2,
             "chat_minutes": 0.15, "chat_new_tokens": 24, "chat_batch": 4, "heldout_prompts": 2, "batch_size": 2,
             "lr": 1e-3, "eval_every_minutes": 0.05, "ttt_steps": 2, "eval_k": 3, "minutes": 0.1}


def settings(kit) -> dict:
    """The run's :class:`~toolkit.distill.eagle_train.EagleTrainConfig` fields: :data:`GPU` on CUDA, with the
    training minutes cut to what the kit's budget leaves (less 4 minutes for data and measurement, and 2.5 more
    when the search follows in the same call; at least 1), else :data:`REHEARSAL`."""
    if kit.device.type != "cuda" or kit.dry_run:
        return dict(REHEARSAL)
    left = kit.time_left() / 60 - 4.0  # H100: data ~1 min, HF's compiled baseline 81 s, the head's chain
    if "search" in kit.args.get("stages", ""):
        left -= 2.5  # the search runs after this stage in the same call: leave it a few trials
    return GPU | {"minutes": max(1.0, min(GPU["minutes"], left))}


def reproduce_command(fields: dict) -> str:
    """The ``toolkit draft eagle`` command line of a run with ``fields`` (data: this repository's files)."""
    names = {"chat_minutes", "chat_prompts", "text_windows", "draft_vocab", "variant", "ttt_steps", "batch_size",
             "seq_len", "lr", "eval_every_minutes", "minutes"}
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fields.items() if k in names)
    data = " ".join(f"--data '{d.replace(str(ROOT) + '/', '')}'" for d in DATA)
    return f"PYTHONPATH=. python3 -m toolkit_cli.eagle --target embedded --out results/eagle/eagle3-gpu --force " \
           f"{options} {data}"


def drafts_through_recipe(kit, head_dir: Path) -> dict:
    """Load ``head_dir`` through the normal recipe path (``toolkit.build``, ``spec.drafter: eagle``) on the embedded
    target and generate: ``{"drafted", "accepted", "tau"}``. Raises ``AssertionError`` when nothing was drafted."""
    import toolkit
    from toolkit.recipe import GenerationSpec, KVSpec, ModelSpec, Recipe, SpeculationSpec

    target, tok = kit.embedded
    recipe = Recipe(name="eagle3-gpu", target=ModelSpec(source="embedded", precision="fp32"),
                    draft=ModelSpec(source=str(head_dir), precision="fp32"), kv=KVSpec("none", {}),
                    spec=SpeculationSpec("eagle", 3, "constant"),
                    generation=GenerationSpec(max_new_tokens=12, ignore_eos=True))
    lm = toolkit.build(recipe, target=target, tokenizer=tok)
    stats = lm.generate([{"role": "user", "content": "Explain what a Python list comprehension is."}]).stats
    if stats.drafted == 0:
        raise AssertionError(f"the head in {head_dir} loaded through the recipe path but drafted nothing")
    return {"drafted": stats.drafted, "accepted": stats.accepted, "tau": stats.tokens_per_round}


def _publish(kit, run: Path, summary: dict, fields: dict) -> Path | None:
    """Copy the best head and a README (settings, curve, command) into ``<out>/eagle3_head``; returns it."""
    if kit.out_dir is None or not (run / "best" / "model.safetensors").is_file():
        return None
    dest = kit.out_dir / "eagle3_head"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(run / "best" / name, dest / name)
    curve = "\n".join(f"| {p['tokens']} | {' / '.join(f'{a:.3f}' for a in p['alpha'])} | {p['tau']:.3f} |"
                      for p in summary["curve"])
    (dest / "README.md").write_text(
        f"# EAGLE-3 head for the embedded SmolLM2-135M-Instruct, trained on {kit.device}\n\n"
        f"Settings: `{json.dumps(fields)}`; data: this repository's files {DATA}.\n\n"
        f"Reproduce (in the repository's root):\n\n    {reproduce_command(fields)}\n\n"
        f"or the kit's stage: `PYTHONPATH=. python3 bench/gpu_bench.py --out OUT --stages environment eagle_train`.\n"
        "\nHeld-out acceptance (greedy, per draft position):\n\n"
        "| training tokens | α per position | τ |\n|---|---|---|"
        f"\n{curve}\n")
    return dest


def eagle_train(kit) -> dict:
    """Train (see the module docstring), publish, check the head through the recipe path, measure it."""
    from toolkit.distill.eagle_train import EagleTrainConfig, train_head

    real = kit.embedded
    if real is None:
        raise RuntimeError("the embedded model was not relayed (bench/README.md): no target to train a head for")
    fields = settings(kit)
    run = Path(tempfile.mkdtemp(prefix="gpu-kit-eagle3-")) / "run"
    target, tok = real_target(kit) if kit.device.type == "cuda" else (copy.deepcopy(real[0]), real[1])
    config = EagleTrainConfig(target="embedded", out=run, data=DATA, seed=0, **fields)
    kit.log(f"eagle_train: {fields['minutes']:.1f} min of training on {kit.device} into {run}")
    summary = train_head(config, target=target, tokenizer=tok, progress=False)
    del target
    out = {"settings": fields, "device": str(kit.device), "steps": summary["steps"], "tokens": summary["tokens"],
           "minutes": summary["minutes"], "best_tau_heldout_chains": summary["best_tau"], "curve": summary["curve"],
           "data": {k: v for k, v in summary["data"].items() if k != "files"}, "reproduce": reproduce_command(fields)}
    head_bytes = (run / "best" / "model.safetensors").stat().st_size
    out["head_bytes"] = head_bytes
    published = _publish(kit, run, summary, fields)
    out["published"] = str(published) if published else None
    kit.partial("eagle_train", out)
    out["recipe_path"] = drafts_through_recipe(kit, run / "best")
    kit.partial("eagle_train", out)
    if not kit.out_of_time("eagle_train: the held-out measurement"):
        out["measured"] = measure_head(kit, run / "best", "EAGLE-3 trained here", None, with_draft=False,
                                       prompts_dir=run)
    return out
