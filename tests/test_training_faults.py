"""Checkpoints and caches of draft distillation and EAGLE training: a file someone hands you never runs code, LATEST
never leads out of the run, and a kill -9 in the middle of a checkpoint loses no finished work.

* hostile pickles (unpickling creates a marker file) in a checkpoint's trainer state, its weights and the EAGLE
  feature caches: never executed, one clear ConfigError (or, for a cache, recomputed);
* ``LATEST`` of ``../../etc``, an absolute path, a symlink out: refused;
* the trainer state round-trips exactly through safetensors + JSON; Ctrl-C is held during an optimizer step;
* a distillation (``python -m toolkit_cli.distill``) and an EAGLE head training run as subprocesses that SIGKILL
  themselves in the middle of their third checkpoint; ``--resume`` continues from the last complete one, with
  the same result as an uninterrupted run (distillation), a clean log and no stale files.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_distill import FILES, SMALL, char_tokenizer

from toolkit.distill import DistillConfig, distill, latest_checkpoint
from toolkit.distill.checkpoints import deferred_interrupts, load_state, save_state, trim_log, write_checkpoint
from toolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


class _Hostile:
    """Unpickling this creates ``path`` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_pickle(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"step": 1, "payload": _Hostile(marker)}))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random 3-layer Llama with the character tokenizer, saved as an HF model directory."""
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(seed=5, layers=3, initializer_range=0.2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ no code from files
def test_trainer_state_round_trips_exactly(tmp_path):
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    sum(p.sum() for p in params).backward()
    optimizer.step()
    state = {"step": 7, "elapsed_s": 1.5, "losses": [2.0, float("nan")], "optimizer": optimizer.state_dict(),
             "torch_rng": torch.get_rng_state(), "cuda_rng": None, "pair": (1, "a"), "__odd": {3: "x"}}
    save_state(tmp_path, state)
    back = load_state(tmp_path)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys stay ints
    for i in (0, 1):
        for key, value in optimizer.state_dict()["state"][i].items():
            assert torch.equal(back["optimizer"]["state"][i][key], value)
    assert torch.equal(back["torch_rng"], state["torch_rng"]) and back["pair"] == (1, "a")
    assert back["__odd"] == {3: "x"} and back["step"] == 7 and back["losses"][0] == 2.0
    fresh = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    fresh.load_state_dict(back["optimizer"])


def _distill_kwargs(out: Path, **extra) -> dict:
    common = {k: v for k, v in SMALL.items() if k not in ("eval_windows", "eval_prompts", "checkpoint_every")}
    return dict(layers=1, tokens=4 * 4 * 64, out=out, eval_windows=1, eval_prompts=0, checkpoint_every=1,
                **common) | extra


def _checkpoint_dir(out: Path, name: str = "step-000001") -> Path:
    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text(name + "\n")
    return path


@pytest.mark.parametrize("where", ["legacy_state", "state_tensors", "weights"])
def test_hostile_pickle_in_a_distillation_checkpoint_never_runs(tmp_path, tokenizer, where):
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    target = tiny_llama(seed=5, layers=3)
    ckpt = _checkpoint_dir(out)
    if where == "legacy_state":  # the old format: trainer_state.pt, a pickle
        hostile_pickle(ckpt / "trainer_state.pt", marker)
        match = "old pickle format"
    elif where == "state_tensors":  # a pickle named like the new format
        hostile_pickle(ckpt / "trainer_state.safetensors", marker)
        (ckpt / "trainer_state.json").write_text('{"step": 1}')
        match = "unreadable trainer state"
    else:  # a valid state next to pickled weights (pytorch_model.bin) instead of model.safetensors
        save_state(ckpt, {"step": 1, "elapsed_s": 0.0, "losses": [1.0], "optimizer": None})
        target.config.save_pretrained(ckpt)
        hostile_pickle(ckpt / "pytorch_model.bin", marker)
        match = "no readable draft weights"
    with pytest.raises(ConfigError, match=match) as info:
        distill(DistillConfig(**_distill_kwargs(out, resume=True)), target_model=target, tokenizer=tokenizer,
                progress=False)
    assert info.value.field == "resume"
    assert not marker.exists(), "a pickle in the checkpoint was executed"


@pytest.mark.parametrize("latest", ["../../etc", "/etc", "..", "escape", "link"])
def test_latest_outside_the_run_is_refused(tmp_path, tokenizer, latest):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    pointer = out / "checkpoints" / "LATEST"
    if latest == "escape":  # a checkpoint name that is a symlink leading out of the run
        (out / "checkpoints" / "step-000001").symlink_to(outside)
        pointer.write_text("step-000001\n")
    elif latest == "link":  # LATEST itself a symlink
        (outside / "LATEST").write_text("step-000001\n")
        pointer.symlink_to(outside / "LATEST")
    else:
        pointer.write_text(latest + "\n")
    with pytest.raises(ConfigError, match="refusing to follow") as info:
        latest_checkpoint(out)
    assert info.value.field == "resume"
    with pytest.raises(ConfigError, match="refusing to follow"):
        distill(DistillConfig(**_distill_kwargs(out, resume=True)), target_model=tiny_llama(seed=5, layers=3),
                tokenizer=tokenizer, progress=False)


def _eagle_config(out: Path, **extra):
    from toolkit.distill.eagle_train import EagleTrainConfig

    options = dict(target="x", out=out, data=FILES, draft_vocab=64, seq_len=96, text_windows=6, chat_prompts=3,
                   chat_new_tokens=8, chat_batch=3, heldout_prompts=3, batch_size=2, minutes=0.03,
                   eval_every_minutes=0.005, warmup_steps=2, eval_k=2, ttt_steps=2)
    return EagleTrainConfig(**(options | extra))


def test_hostile_pickles_in_eagle_caches_and_checkpoints_never_run(tmp_path, tokenizer):
    from toolkit.distill.eagle_data import prepare_data
    from toolkit.distill.eagle_train import train_head

    marker = tmp_path / "pwned"
    target = tiny_llama(seed=0, initializer_range=0.2)
    out = tmp_path / "head"
    # pickled feature caches of the old format: ignored and recomputed, never unpickled
    for split in ("train", "heldout"):
        hostile_pickle(out / "data" / f"features-{split}.pt", marker)
    (out / "data" / "eagle_manifest.json").write_text("{}")
    data = prepare_data(_eagle_config(out), target, tokenizer)
    assert data["train"]["features"].shape[1:] == (96, 64) and not marker.exists()
    # a pickle under the new cache name: one clear error naming the field
    hostile_pickle(out / "data" / "features-train.safetensors", marker)
    with pytest.raises(ConfigError, match="not a feature cache") as info:
        train_head(_eagle_config(out, resume=True), target=target, tokenizer=tokenizer, progress=False)
    assert info.value.field == "data" and not marker.exists()
    (out / "data" / "features-train.safetensors").unlink()
    # a checkpoint whose trainer state is a pickle: refused
    hostile_pickle(_checkpoint_dir(out, "step-000003") / "trainer_state.pt", marker)
    with pytest.raises(ConfigError, match="old pickle format") as info:
        train_head(_eagle_config(out, resume=True), target=target, tokenizer=tokenizer, progress=False)
    assert info.value.field == "resume" and not marker.exists()


# ------------------------------------------------------------------------------------------------ atomicity
@pytest.fixture
def sigint_disposition():
    """Set SIGINT's handler for one test and restore it after (a job started in the background of a non-interactive
    shell inherits SIGINT ignored, so the test cannot rely on Python's default handler being there)."""
    original = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, original)


def test_ctrl_c_is_held_until_the_step_is_applied(sigint_disposition):
    sigint_disposition(signal.default_int_handler)
    applied = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            applied.append("update")  # still runs: the interrupt waits for the block's end
            applied.append("bookkeeping")
    assert applied == ["update", "bookkeeping"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_held_ctrl_c_keeps_an_ignored_sigint_ignored(sigint_disposition):
    sigint_disposition(signal.SIG_IGN)  # e.g. under nohup ... & : the process asked not to be interrupted
    applied = []
    with deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        applied.append("update")
    assert applied == ["update"] and signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_resaving_a_step_switches_latest_atomically(tmp_path):
    first = write_checkpoint(tmp_path, 5, lambda d: (d / "a").write_text("1"))
    assert first.name == "step-000005"

    def interrupted(d: Path) -> None:
        (d / "a").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 5, interrupted)
    assert latest_checkpoint(tmp_path) == first and (first / "a").read_text() == "1"
    second = write_checkpoint(tmp_path, 5, lambda d: (d / "a").write_text("2"))
    assert second.name == "step-000005.1" and latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["LATEST", "step-000005.1"]


def test_trim_log_drops_redone_steps_and_a_cut_line(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    trim_log(log, 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


# ------------------------------------------------------------------------------------------------ kill -9
_KILLER = """
import os, signal, sys
import {module} as trainer
calls = [0]
original = trainer.save_state
def save_state(directory, state):  # weights already written into the temporary checkpoint directory
    calls[0] += 1
    if calls[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    original(directory, state)
trainer.save_state = save_state
"""


def _run_killed(script: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]


def _log_steps(out: Path) -> list[int]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]  # every line is complete JSON
    return [e["step"] for e in entries if "event" not in e]


def _no_stale_files(out: Path) -> None:
    entries = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(entries) == 2 and entries[0] == "LATEST" and entries[1].startswith("step-"), entries
    assert not [p for p in out.rglob(".*") if p.name not in (".gitignore", ".toolkit-output")], list(out.rglob(".*"))


@pytest.mark.slow
@pytest.mark.system
def test_distillation_killed_mid_checkpoint_resumes_without_loss(tmp_path, model_dir):
    from typer.testing import CliRunner

    from toolkit_cli.app import app

    out = tmp_path / "draft"
    args = ["--target", str(model_dir), "--layers", "1", "--tokens", str(6 * 4 * 64), "--out", str(out),
            "--batch-size", "4", "--seq-len", "64", "--lr", "3e-3", "--checkpoint-every", "1", "--eval-windows", "1",
            "--eval-prompts", "0", "--device", "cpu", "--precision", "fp32", "--threads", "1"]
    for f in FILES:
        args += ["--data", f]
    _run_killed(_KILLER.format(module="toolkit.distill.outputs") + textwrap.dedent(f"""
        sys.argv = ["distill"] + {args!r}
        from toolkit_cli.distill import main
        main()
    """), tmp_path)
    assert latest_checkpoint(out).name == "step-000002"  # the third save (step 3) was cut in half
    assert not (out / "metrics.json").exists()
    result = CliRunner().invoke(app, ["draft", "distill", *args, "--resume"])
    assert result.exit_code == 0, result.output
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["training"]["resumed_from_step"] == 2 and resumed["training"]["steps"] == 6
    assert _log_steps(out) == [1, 2, 3, 4, 5, 6]
    _no_stale_files(out)
    # nothing lost: the same losses and weights as an uninterrupted run
    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec

    target, tokenizer = load_model(ModelSpec(source=str(model_dir), precision="fp32", device="cpu"))
    full = distill(DistillConfig(**_distill_kwargs(tmp_path / "full", tokens=6 * 4 * 64)), target_model=target,
                   tokenizer=tokenizer, progress=False)
    assert resumed["training"]["losses"] == pytest.approx(full["training"]["losses"], rel=1e-4, abs=1e-7)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(out / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.system
def test_eagle_training_killed_mid_checkpoint_resumes_without_loss(tmp_path, model_dir):
    from toolkit.distill.eagle_train import train_head
    from toolkit.eagle.checkpoint import load_head
    from toolkit.models import load_model
    from toolkit.recipe import ModelSpec

    out = tmp_path / "head"
    _run_killed(_KILLER.format(module="toolkit.distill.eagle_train") + textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        from test_training_faults import _eagle_config
        from toolkit.distill.eagle_train import train_head
        from toolkit.models import load_model
        from toolkit.recipe import ModelSpec
        target, tokenizer = load_model(ModelSpec(source={str(model_dir)!r}, precision="fp32", device="cpu"))
        train_head(_eagle_config({str(out)!r}), target=target, tokenizer=tokenizer, progress=False)
    """), tmp_path)
    checkpoint = latest_checkpoint(out)
    saved = load_state(checkpoint)["state"]
    assert saved["step"] > 0 and len(saved["curve"]) == 2  # the step-0 evaluation and one more
    target, tokenizer = load_model(ModelSpec(source=str(model_dir), precision="fp32", device="cpu"))
    summary = train_head(_eagle_config(out, resume=True), target=target, tokenizer=tokenizer, progress=False)
    assert summary["curve"][:2] == saved["curve"] and summary["steps"] > saved["step"]
    steps = _log_steps(out)
    assert steps == list(range(1, summary["steps"] + 1))  # every finished step once, none lost, none twice
    assert json.loads((out / "curve.json").read_text()) == summary["curve"]
    _no_stale_files(out)
    load_head(out / "best", target)  # the published best head is complete


@pytest.mark.slow
def test_an_eagle3_run_trains_from_its_own_feature_caches_and_resumes(tmp_path, tokenizer):
    """``variant: eagle3`` end to end (data, training, checkpoints, ``best/``): the feature caches carry the three
    layers' outputs (an EAGLE-1 run's caches in the same directory are recomputed, not misread), ``best/`` is an
    EAGLE-3 head that loads, and a resumed run continues from the checkpoint."""
    from toolkit.distill.eagle_data import prepare_data
    from toolkit.distill.eagle_train import train_head
    from toolkit.eagle.checkpoint import load_head

    target = tiny_llama(seed=0, layers=4, initializer_range=0.2)
    out = tmp_path / "head"
    assert "aux" not in prepare_data(_eagle_config(out), target, tokenizer)["train"]  # an EAGLE-1 run's caches
    summary = train_head(_eagle_config(out, variant="eagle3", resume=True), target=target, tokenizer=tokenizer,
                         progress=False)
    data = prepare_data(_eagle_config(out), target, tokenizer, [1, 1, 0])
    assert data["train"]["aux"].shape[1:] == (96, 3 * 64) and data["manifest"]["aux_layers"] == [1, 1, 0]
    head = load_head(out / "best", target)
    assert head.config.variant == "eagle3" and head.config.feature_layers == [1, 1, 0]
    resumed = train_head(_eagle_config(out, variant="eagle3", resume=True, minutes=0.06), target=target,
                         tokenizer=tokenizer, progress=False)
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert resumed["steps"] > summary["steps"] > 0
    assert steps == list(range(1, resumed["steps"] + 1))  # continued from the checkpoint: no second step 1
