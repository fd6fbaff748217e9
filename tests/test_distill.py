"""Draft distillation (toolkit.distill) on tiny random targets: loss goes down, the saved draft is a loadable HF model
that drives the speculative decoder losslessly, resume continues exactly, bad input gives one clear error each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from toolkit.distill import DistillConfig, distill, latest_checkpoint
from toolkit.errors import ConfigError

STDLIB = Path(os.path.dirname(os.__file__))
FILES = [str(STDLIB / name) for name in ("functools.py", "bisect.py", "heapq.py", "abc.py", "colorsys.py")]
SMALL = dict(batch_size=4, seq_len=64, lr=3e-3, eval_windows=4, eval_prompts=2, eval_prompt_len=16,
             eval_new_tokens=12, eval_k=4, data=FILES, checkpoint_every=1000)


def char_tokenizer():
    """A character-level fast tokenizer with 99 entries (fits tiny_llama's vocab of 128)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "</s>", "\n", "\t"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls run fastest (and least disturbed by other processes) on one thread; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def run30(tmp_path_factory, tokenizer):
    """A 30-step distillation of a 2-layer draft from a 4-layer tiny random Llama."""
    out = tmp_path_factory.mktemp("distill") / "draft"
    target = tiny_llama(seed=3, layers=4)
    metrics = distill(DistillConfig(layers=2, tokens=30 * 4 * 64, out=out, **SMALL), target_model=target,
                      tokenizer=tokenizer, progress=False)
    return target, out, metrics


def test_30_steps_lower_the_kl_loss(run30):
    _, out, metrics = run30
    losses = metrics["training"]["losses"]
    assert metrics["training"]["steps"] == 30 and len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    # held-out KL and top-1 agreement improve too (measured on text never trained on)
    assert metrics["after"]["kl"] < metrics["before"]["kl"]
    assert metrics["after"]["top1_agreement"] > metrics["before"]["top1_agreement"]
    for key in ("alpha", "tokens_per_round"):
        assert key in metrics["before"] and key in metrics["after"]
    assert (out / "metrics.json").is_file() and "| top-1 agreement |" in (out / "report.md").read_text()


def test_saved_draft_loads_through_modelspec_and_decodes_like_ar(run30, tokenizer):
    from toolkit.models import check_same_vocab, load_model
    from toolkit.recipe import GenerationSpec, ModelSpec
    from toolkit.engine.planner import ConstantK
    from toolkit.engine.decoder import SpeculativeDecoder
    from toolkit.speculative.drafters import DraftModel
    from toolkit.speculative.stats import GenerationStats

    target, out, _ = run30
    draft, draft_tokenizer = load_model(ModelSpec(source=str(out), precision="fp32", device="cpu"))
    assert type(draft) is type(target) and draft.config.num_hidden_layers == 2
    check_same_vocab(tokenizer, draft_tokenizer, "target", "draft")
    # the frozen embedding is the target's
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    prompt = torch.tensor([tokenizer("def bisect_left(a, x):\n")["input_ids"]])
    gen = GenerationSpec(max_new_tokens=24, do_sample=False, ignore_eos=True)

    def run(drafter):
        stats = GenerationStats()
        ids = [t for chunk in SpeculativeDecoder(target, drafter, ConstantK(3)).decode(prompt, gen, stats)
               for t in chunk]
        return ids, stats

    ar_ids, _ = run(None)
    spec_ids, stats = run(DraftModel(draft))
    assert spec_ids == ar_ids and len(ar_ids) == 24
    assert stats.drafted > 0 and stats.rounds >= 2


def test_resume_continues_from_the_saved_step(tmp_path, tokenizer):
    common = dict(layers=1, tokens=8 * 4 * 64, eval_windows=1, eval_prompts=0, checkpoint_every=3,
                  **{k: v for k, v in SMALL.items() if k not in ("eval_windows", "eval_prompts", "checkpoint_every")})
    target = tiny_llama(seed=5, layers=3)
    full = distill(DistillConfig(out=tmp_path / "full", **common), target_model=target, tokenizer=tokenizer,
                   progress=False)

    def interrupt(step, loss):
        if step == 5:
            raise KeyboardInterrupt

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        distill(DistillConfig(out=out, **common), target_model=target, tokenizer=tokenizer, callback=interrupt,
                progress=False)
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "step-000005"
    assert not (out / "metrics.json").exists()
    seen = []
    resumed = distill(DistillConfig(out=out, resume=True, **common), target_model=target, tokenizer=tokenizer,
                      callback=lambda step, loss: seen.append(step), progress=False)
    assert resumed["training"]["resumed_from_step"] == 5
    assert seen == [6, 7, 8]
    assert resumed["training"]["steps"] == full["training"]["steps"] == 8
    # nothing lost: same losses and same final weights as the uninterrupted run
    assert resumed["training"]["losses"] == pytest.approx(full["training"]["losses"], rel=1e-4, abs=1e-7)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


def _field(excinfo) -> str:
    return excinfo.value.field


def test_bad_input_gives_one_clear_error_each(tmp_path, tokenizer):
    target = tiny_llama(layers=3)
    kwargs = dict(target_model=target, tokenizer=tokenizer, progress=False)
    for layers in (0, -1):
        with pytest.raises(ConfigError) as excinfo:
            distill(DistillConfig(layers=layers, out=tmp_path / "a", **SMALL), **kwargs)
        assert _field(excinfo) == "layers"
    for layers in (3, 4):
        with pytest.raises(ConfigError, match="layers < 3") as excinfo:
            distill(DistillConfig(layers=layers, out=tmp_path / "a", **SMALL), **kwargs)
        assert _field(excinfo) == "layers"
    with pytest.raises(ConfigError, match="no LM head") as excinfo:  # a bare decoder, no *ForCausalLM head
        distill(DistillConfig(layers=1, out=tmp_path / "a", **SMALL), target_model=target.model,
                tokenizer=tokenizer, progress=False)
    assert _field(excinfo) == "target"
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "something.txt").write_text("x")
    with pytest.raises(ConfigError, match="--resume") as excinfo:
        distill(DistillConfig(layers=1, out=existing, **SMALL), **kwargs)
    assert _field(excinfo) == "out"
    assert (existing / "something.txt").is_file()  # nothing was touched
    with pytest.raises(ConfigError) as excinfo:
        distill(DistillConfig(layers=1, out=existing, resume=True, force=True, **SMALL), **kwargs)
    assert _field(excinfo) == "resume"
    assert not (tmp_path / "a").exists()  # bad input never creates the output directory


def test_init_layers_are_evenly_spaced():
    cfg = DistillConfig(layers=2)
    assert cfg.init_layers(30) == [0, 29]
    assert DistillConfig(layers=4).init_layers(30) == [0, 10, 19, 29]
    assert DistillConfig(layers=1).init_layers(30) == [29]
    assert DistillConfig(layers=2, init="3,7").init_layers(30) == [3, 7]
    with pytest.raises(ConfigError) as excinfo:
        DistillConfig(layers=2, init="3,70").init_layers(30)
    assert excinfo.value.field == "init"


def test_layers_initialized_from_target_layers(tokenizer):
    from toolkit.distill import build_draft

    target = tiny_llama(layers=4)
    draft = build_draft(target, 2, [0, 3])
    for i, src in enumerate((0, 3)):
        torch.testing.assert_close(draft.model.layers[i].mlp.down_proj.weight,
                                   target.model.layers[src].mlp.down_proj.weight)
    assert not draft.get_input_embeddings().weight.requires_grad
    assert draft.model.layers[0].self_attn.q_proj.weight.requires_grad


def test_default_data_split_is_deterministic_by_file_and_disjoint():
    from toolkit.distill.data import resolve_files

    first, second = resolve_files([], 0.05), resolve_files([], 0.05)
    assert first == second
    assert first["train"] and first["heldout"]
    assert not set(first["train"]) & set(first["heldout"])
    held = first["heldout"]
    assert any(p.endswith(".py") for p in held)  # code is held out ...
    if Path("/usr/share/common-licenses").is_dir():  # ... and so is prose
        assert any(p.startswith("/usr/share/common-licenses") for p in held)


def test_cli_reports_the_field(tmp_path):
    import typer
    from typer.testing import CliRunner

    from toolkit_cli.distill import distill_command

    app = typer.Typer()
    app.command()(distill_command)
    result = CliRunner().invoke(app, ["--layers", "0", "--out", str(tmp_path / "x"), "--tokens", "1k"])
    assert result.exit_code == 2
    assert "layers" in result.output
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "f").write_text("x")
    result = CliRunner().invoke(app, ["--layers", "1", "--out", str(existing), "--tokens", "1k"])
    assert result.exit_code == 2 and "out:" in result.output and "--resume" in result.output
