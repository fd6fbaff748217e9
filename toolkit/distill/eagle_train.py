"""Train an EAGLE head for a target (``toolkit draft eagle``): EAGLE-1 layout, reduced draft vocabulary, EAGLE-3's
training-time test.

Recipe (Li et al. 2024 EAGLE; Li et al. 2025 EAGLE-3; Zhao et al. 2025 FR-Spec), measured here on SmolLM2:

* Features are the target's last-layer outputs *after* its final norm (SmolLM2's pre-norm features have massive
  activations: a raw regression is dominated by a few dimensions). The head predicts the next normed feature.
* Loss per position: a token-level loss — KL(target || head) over the draft vocabulary, with the target's
  distribution read from its own next feature through the frozen LM head — plus ``reg_weight`` x SmoothL1 of the
  feature error standardised per dimension.
* Training-time test: the head is unrolled ``ttt_steps`` draft steps; step s reads its own step s-1 output, and its
  attention sees the true-feature keys up to the chain's start plus its own earlier draft steps (the exact
  attention pattern of drafting), losses weighted ``ttt_decay ** (s-1)``.
* Held-out acceptance: on target-generated answers to held-out prompts, every position starts a greedy draft chain
  of ``eval_k`` steps; ``alpha[j]`` = P(draft j matches the target's argmax | drafts 1..j-1 matched) — exactly what
  the speculative decoder would accept greedily (inputs are the target's own tokens, which the accepted drafts are).

Outputs in ``out``: ``data/`` (feature caches), ``checkpoints/step-N`` (atomic, resumable), ``best/`` (the head with
the highest held-out expected accepted length), ``curve.json`` / ``curve.png`` (alpha per position vs training
tokens), ``train_log.jsonl``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.checks import TOKENS_MAX, check_choice, check_float, check_int, check_seed, check_str_list
from toolkit.errors import ConfigError
from toolkit.io import atomic_write_json, atomic_write_png

log = logging.getLogger(__name__)

DEFAULT_DATA = ["/usr/lib/python3*/*.py", "/usr/share/common-licenses/*", "/usr/share/doc/*/README*",
                "/usr/share/doc/*/*.txt", "/usr/share/doc/*/*.md"]


@dataclass
class EagleTrainConfig:
    """A head-training run. Token counts are per window (``seq_len``); ``minutes`` bounds the training loop.

    Attributes:
        target: ``ModelSpec.source`` of the target; data precision ``target_precision`` (bf16 on CPU is fine).
        out: output directory. data: text globs (``.gz`` skipped). draft_vocab: size of the reduced vocabulary.
        text_windows / chat_prompts / chat_minutes / chat_new_tokens: corpus size and the self-generated answers.
        heldout_prompts: held-out chat prompts for the acceptance curve.
        ttt_steps / ttt_decay / reg_weight: the loss (see the module docstring).
        batch_size / seq_len / lr / warmup_steps / minutes: the optimisation; ``minutes`` = training wall time.
        eval_every_minutes / eval_k: held-out acceptance evaluation cadence and chain length.
    """

    target: str = "embedded"
    target_precision: str = "bf16"
    out: str | Path = "results/eagle/head"
    data: list[str] = field(default_factory=lambda: list(DEFAULT_DATA))
    draft_vocab: int = 8192
    seq_len: int = 320
    text_windows: int = 320
    chat_prompts: int = 800
    chat_minutes: float = 8.0
    chat_new_tokens: int = 160
    chat_batch: int = 16
    heldout_prompts: int = 40
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    reg_weight: float = 0.1
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    minutes: float = 30.0
    eval_every_minutes: float = 3.0
    eval_k: int = 5
    seed: int = 0
    resume: bool = False
    force: bool = False
    autocast: bool = True

    def validate(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("target", "must be a model source: 'embedded', a local directory or a hub id")
        check_choice("target_precision", self.target_precision, ("fp32", "bf16"))
        self.data = check_str_list("data", self.data, "text files or globs")
        check_int("draft_vocab", self.draft_vocab, low=16, high=TOKENS_MAX)
        check_int("seq_len", self.seq_len, low=8, high=TOKENS_MAX)
        check_int("text_windows", self.text_windows, low=0, high=10**7)
        check_int("chat_prompts", self.chat_prompts, low=0, high=10**7)
        check_float("chat_minutes", self.chat_minutes, low=0.0)
        check_int("chat_new_tokens", self.chat_new_tokens, low=1, high=TOKENS_MAX)
        check_int("chat_batch", self.chat_batch, low=1, high=4096)
        check_int("heldout_prompts", self.heldout_prompts, low=1, high=10**6)
        check_int("ttt_steps", self.ttt_steps, low=1, high=8)
        check_float("ttt_decay", self.ttt_decay, low=0.0, high=1.0)
        check_float("reg_weight", self.reg_weight, low=0.0)
        check_int("batch_size", self.batch_size, low=1, high=65536)
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_int("warmup_steps", self.warmup_steps, low=0, high=10**9)
        check_float("minutes", self.minutes, low=0.0, low_open=True)
        check_float("eval_every_minutes", self.eval_every_minutes, low=0.0, low_open=True)
        check_int("eval_k", self.eval_k, low=1, high=16)
        check_seed("seed", self.seed)
        for name in ("resume", "force", "autocast"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.resume and self.force:
            raise ConfigError("resume", "--resume and --force are mutually exclusive")
        self.out = Path(self.out).expanduser()


def expand_data(entries: list[str]) -> list[str]:
    """Globs -> sorted existing regular files (``.gz`` and other compressed files skipped)."""
    files = set()
    for entry in entries:
        for path in glob.glob(os.path.expanduser(entry), recursive=True):
            p = Path(path)
            if p.is_file() and p.suffix not in (".gz", ".xz", ".bz2", ".zst"):
                files.add(str(p.resolve()))
    if not files:
        raise ConfigError("data", f"no file matches {entries}")
    return sorted(files)


# ------------------------------------------------------------------------------------------------ data
def prepare_data(config: EagleTrainConfig, target, tokenizer) -> dict:
    """Build (or read back) ``{"train": cache, "heldout": cache, "manifest": ...}`` of feature caches."""
    from toolkit.distill.data import load_streams, resolve_files
    from toolkit.distill.eagle_data import atomic_save, chat_prompts, compute_features, generate_answers

    data_dir = config.out / "data"
    paths = {s: data_dir / f"features-{s}.pt" for s in ("train", "heldout")}
    if all(p.is_file() for p in paths.values()):
        return {s: torch.load(p, weights_only=False) for s, p in paths.items()} | {
            "manifest": json.loads((data_dir / "eagle_manifest.json").read_text())}
    files = expand_data(config.data)
    split = resolve_files(files, 0.05)
    streams, manifest = load_streams(files, 0.05, tokenizer, data_dir)
    pad = tokenizer.eos_token_id
    t0 = time.monotonic()
    held_prompts = chat_prompts(split, "heldout", config.heldout_prompts, config.seed)
    held_rows = generate_answers(target, tokenizer, held_prompts, config.chat_new_tokens, config.chat_batch,
                                 math.inf, config.seq_len - config.chat_new_tokens)
    train_prompts = chat_prompts(split, "train", config.chat_prompts, config.seed)
    train_rows = generate_answers(target, tokenizer, train_prompts, config.chat_new_tokens, config.chat_batch,
                                  config.chat_minutes, config.seq_len - config.chat_new_tokens)
    chat_s = time.monotonic() - t0
    text = streams["train"]
    n_windows = min(config.text_windows, text.numel() // config.seq_len)
    gen = torch.Generator().manual_seed(config.seed)
    starts = torch.randperm(text.numel() // config.seq_len, generator=gen)[:n_windows] * config.seq_len
    text_rows = [text[s:s + config.seq_len].tolist() for s in starts.tolist()]
    held_text = streams["heldout"]
    held_text_rows = [held_text[i * config.seq_len:(i + 1) * config.seq_len].tolist()
                      for i in range(min(8, held_text.numel() // config.seq_len))]
    t1 = time.monotonic()
    caches = {}
    for name, chat, texts in (("heldout", held_rows, held_text_rows), ("train", train_rows, text_rows)):
        cache = compute_features(target, [r for r, _ in chat] + texts, config.seq_len, pad)
        cache["kind"] = torch.tensor([1] * len(chat) + [0] * len(texts))
        cache["answer_start"] = torch.tensor([p for _, p in chat] + [0] * len(texts))
        atomic_save(cache, paths[name])
        caches[name] = cache
    manifest = {"files": split, "chat_sequences": {"train": len(train_rows), "heldout": len(held_rows)},
                "chat_tokens": {"train": sum(len(r) for r, _ in train_rows),
                                "heldout": sum(len(r) for r, _ in held_rows)},
                "text_windows": {"train": len(text_rows), "heldout": len(held_text_rows)},
                "seq_len": config.seq_len, "chat_seconds": round(chat_s, 1),
                "feature_seconds": round(time.monotonic() - t1, 1),
                "heldout_prompts": held_prompts[:len(held_rows)]}
    atomic_write_json(data_dir / "eagle_manifest.json", manifest)
    caches["manifest"] = manifest
    return caches


# ------------------------------------------------------------------------------------------------ the unrolled head
def ttt_mask(length: int, step: int, device) -> torch.Tensor:
    """Attention mask ``(length, step * length)`` of draft step ``step`` (1-based) in the unrolled head: the query
    at position t sees step-1 keys at positions <= t - step + 1 and step-j keys (2 <= j <= step) at t - step + j."""
    pos = torch.arange(length, device=device)
    blocks = [pos[None, :] <= (pos[:, None] - step + 1)]
    for j in range(2, step + 1):
        blocks.append(pos[None, :] == (pos[:, None] - step + j))
    mask = torch.cat(blocks, dim=1)
    mask[:, (step - 1) * length:].fill_diagonal_(True)  # own key: never an empty row
    return mask


def unroll(head, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Outputs of ``steps`` unrolled draft steps over a batch: ``features`` ``(b, L, H)`` (normed target features),
    ``tokens`` ``(b, L)``. Level s output at position t predicts token t+2 from the chain that starts with the true
    pair at t-s+1. Returns ``[out_1 .. out_steps]`` each ``(b, L-1, H)``."""
    b, length = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(length, device=tokens.device).expand(b, length)
    next_tokens = tokens[:, 1:]
    x = head.input_features(features[:, :-1], next_tokens)
    keys, values = [], []
    outs = []
    for s in range(1, steps + 1):
        if s > 1:
            prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)  # out at t-1 -> input t
            x = head.step_input(prev, next_tokens)
        extra = (torch.cat(keys, dim=2), torch.cat(values, dim=2)) if keys else None
        mask = ttt_mask(length, s, tokens.device)
        out, (k, v) = head(x, next_tokens, positions, None, mask, extra)
        keys.append(k)
        values.append(v)
        outs.append(out)
    return outs


def target_log_probs(head, features: torch.Tensor) -> torch.Tensor:
    """The target's next-token log-probabilities restricted to the draft vocabulary, renormalised:
    ``(..., draft_vocab)`` from normed features ``(..., H)`` through the frozen (reduced) LM head."""
    return F.log_softmax(head.lm_head(features).float(), dim=-1)


def _target_argmax(cache: dict, full_lm_head: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each position ``t + 1``: ``(n, L-1)``, computed once and kept in ``cache``."""
    if "target_next" not in cache:
        rows = []
        with torch.inference_mode():
            for i in range(0, cache["features"].shape[0], 8):
                rows.append((cache["features"][i:i + 8, 1:].float() @ full_lm_head.T).argmax(-1))
        cache["target_next"] = torch.cat(rows)
    return cache["target_next"]


def alpha_curve(head, cache: dict, k: int, full_lm_head: torch.Tensor, kinds=(1,), batch: int = 8) -> dict:
    """Held-out acceptance per draft position (greedy; see the module docstring). Returns ``{"alpha": [k],
    "tau": expected tokens per round with K=k (accepted + bonus), "chains": n}``."""
    sel = torch.isin(cache["kind"], torch.tensor(list(kinds)))
    feats, toks, mask = cache["features"][sel], cache["tokens"][sel], cache["mask"][sel]
    reached = torch.zeros(k + 1)
    with torch.inference_mode():
        for i in range(0, feats.shape[0], batch):
            f = feats[i:i + batch].float()
            t, m = toks[i:i + batch], mask[i:i + batch]
            outs = unroll(head, f, t, k)
            target_next = _target_argmax(cache, full_lm_head)[sel][i:i + batch]  # (b, L-1)
            ok = []
            for s, out in enumerate(outs, start=1):
                draft = head.draft_to_target[head.logits(out).argmax(-1)]
                good = (draft == target_next) & m[:, 1:] & torch.cat(
                    [m[:, 2:], torch.zeros_like(m[:, :1])], dim=1)
                ok.append(good)
            length = toks.shape[1] - 1
            # chain starting at m0 (true pair at m0): step s correct = ok[s-1][:, m0 + s - 1]
            alive = m[:, 1:] & torch.cat([m[:, 2:], torch.zeros_like(m[:, :1])], dim=1)
            # chains start where drafting starts at inference: at the last prompt position or later
            start = cache["answer_start"][sel][i:i + batch]
            alive &= torch.arange(length)[None, :] >= (start[:, None] - 1)
            reached[0] += alive.sum()
            for s in range(1, k + 1):
                shifted = torch.zeros_like(alive)
                shifted[:, :length - s + 1] = ok[s - 1][:, s - 1:]
                alive = alive & shifted
                reached[s] += alive.sum()
    alpha = [(reached[s] / reached[s - 1]).item() if reached[s - 1] > 0 else 0.0 for s in range(1, k + 1)]
    tau = 1.0 + sum((reached[s] / reached[0]).item() for s in range(1, k + 1))
    return {"alpha": alpha, "tau": tau, "chains": int(reached[0])}


# ------------------------------------------------------------------------------------------------ training
def head_loss(head, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, weights: list[float],
              reg_weight: float, std: torch.Tensor | float = 1.0, autocast: bool = False):
    """The training loss over a batch: for each unrolled step s (weight ``weights[s-1]``), KL(target || head) over
    the draft vocabulary + ``reg_weight`` x SmoothL1 of the standardised feature error, averaged over ``valid``
    ``(b, L-1)`` positions (step s only from position s-1 on). ``features`` ``(b, L, H)`` normed target features,
    ``tokens`` ``(b, L)``. Returns ``(loss, [per-step KL in nats])``."""
    with torch.no_grad():
        goal = features[:, 1:]  # outputs at position t predict the feature of token t+1 (its next-token law)
        p_log = target_log_probs(head, goal)
        p = p_log.exp()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = unroll(head, features, tokens, len(weights))
    loss = 0.0
    parts = []
    denom = valid.sum().clamp_min(1)
    for s, (w, o) in enumerate(zip(weights, outs)):
        level_valid = valid.clone()
        level_valid[:, :s] = 0
        logq = F.log_softmax(head.logits(o.float()).float(), dim=-1)
        kl = (p * (p_log - logq)).sum(-1)
        reg = F.smooth_l1_loss(o.float() / std, goal / std, reduction="none").mean(-1)
        loss = loss + w * ((kl + reg_weight * reg) * level_valid).sum() / denom
        parts.append(round(float(kl.detach().mul(level_valid).sum() / denom), 4))
    return loss, parts


def build_head(target, draft_vocab: int, counts: torch.Tensor, seed: int):
    """A fresh EAGLE-1-layout head for ``target`` with the ``draft_vocab`` most frequent tokens of ``counts``."""
    from toolkit.eagle.head import EagleHead, HeadConfig
    from toolkit.eagle.vocab import frequent_tokens

    torch.manual_seed(seed)
    config = HeadConfig.from_target(target.config, "eagle1", draft_vocab)
    head = EagleHead(config)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    h = config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, h:] = torch.eye(h)  # start as "pass the feature through"
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
    eos = [target.config.eos_token_id] if isinstance(target.config.eos_token_id, int) else list(
        target.config.eos_token_id or [])
    ids = frequent_tokens(counts, draft_vocab, eos)
    head.draft_to_target = ids
    embedding = target.get_input_embeddings().weight.detach().float().cpu()
    lm = target.get_output_embeddings().weight.detach().float().cpu()
    head.embed_tokens.weight.data.copy_(embedding)
    head.lm_head.weight.data.copy_(lm[ids])
    head.embed_tokens.requires_grad_(False)
    head.lm_head.requires_grad_(False)
    return head


def _save_checkpoint(out: Path, head, state: dict) -> None:
    from toolkit.distill.trainer import write_checkpoint
    from toolkit.eagle.checkpoint import save_head

    def write(tmp: Path) -> None:
        save_head(head, tmp)
        torch.save(state, tmp / "trainer_state.pt")

    write_checkpoint(out, state["step"], write)


def _save_best(out: Path, head) -> None:
    from toolkit.eagle.checkpoint import save_head

    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".best."))
    save_head(head, tmp, dtype=torch.bfloat16)
    best = out / "best"
    old = out / ".best.old"
    if best.exists():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)


def _plot(curve: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["tokens"] for c in curve]
    for j in range(len(curve[0]["alpha"])):
        ax.plot(xs, [c["alpha"][j] for c in curve], marker="o", label=f"alpha{j + 1}")
    ax.set_xlabel("training tokens (positions x unrolled steps not counted)")
    ax.set_ylabel("held-out acceptance (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


def train_head(config: EagleTrainConfig, target=None, tokenizer=None, progress: bool = True) -> dict:
    """Run (or resume) a head-training run; returns the final summary also written to ``out/summary.json``.

    Raises:
        ConfigError: a field is invalid (named), ``out`` exists without ``resume`` / ``force``, or ``force`` on a
            directory the toolkit did not create (:mod:`toolkit.outdirs`).
    """
    from toolkit.outdirs import check_removable, make_output_dir, remove_output_dir

    config.validate()
    out: Path = config.out
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (config.resume or config.force):
        raise ConfigError("out", f"{out} exists; pass --resume to continue or --force to start over")
    if config.force:
        check_removable(out, "out")
    if target is None:
        from toolkit.models import load_model
        from toolkit.recipe import ModelSpec

        target, tokenizer = load_model(ModelSpec(source=config.target, precision=config.target_precision),
                                       field="target")
    if config.draft_vocab > target.config.vocab_size:  # before the (long) data preparation
        raise ConfigError("draft_vocab", f"must be <= the target's vocab_size {target.config.vocab_size}, got "
                          f"{config.draft_vocab}")
    if config.force:
        remove_output_dir(out, "out")
    make_output_dir(out, "out")
    atomic_write_json(out / "config.json.run", dataclasses.asdict(config) | {"out": str(out)})
    data = prepare_data(config, target, tokenizer)
    train, held = data["train"], data["heldout"]
    vocab = target.config.vocab_size
    counts = torch.bincount(train["tokens"][train["mask"]], minlength=vocab).double()
    chat = train["kind"] == 1
    counts += 3 * torch.bincount(train["tokens"][chat][train["mask"][chat]], minlength=vocab).double()
    head = build_head(target, config.draft_vocab, counts, config.seed)
    full_lm = target.get_output_embeddings().weight.detach().float().cpu()
    std = train["features"][:64][train["mask"][:64]].float().std(0).clamp_min(1e-3)

    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"step": 0, "elapsed_s": 0.0, "tokens": 0, "curve": [], "best_tau": 0.0}
    pointer = out / "checkpoints" / "LATEST"
    if config.resume and pointer.is_file():
        ckpt = out / "checkpoints" / pointer.read_text().strip()
        saved = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        head.load_state_dict(saved["head"])
        head.draft_to_target = saved["draft_to_target"]
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        log.info("resumed at step %d", state["step"])

    def snapshot() -> dict:
        return {"head": head.state_dict(), "draft_to_target": head.draft_to_target, "optimizer":
                optimizer.state_dict(), "state": state, "step": state["step"]}

    def evaluate() -> None:
        head.eval()
        chat_alpha = alpha_curve(head, held, config.eval_k, full_lm, kinds=(1,))
        text_alpha = alpha_curve(head, held, config.eval_k, full_lm, kinds=(0,))
        head.train()
        point = {"step": state["step"], "tokens": state["tokens"], "minutes": state["elapsed_s"] / 60,
                 "alpha": chat_alpha["alpha"], "tau": chat_alpha["tau"], "chains": chat_alpha["chains"],
                 "text_alpha": text_alpha["alpha"], "text_tau": text_alpha["tau"]}
        state["curve"].append(point)
        log.info("eval step %d tokens %d: alpha %s tau %.3f | text alpha %s", state["step"], state["tokens"],
                 [round(a, 3) for a in point["alpha"]], point["tau"], [round(a, 3) for a in point["text_alpha"]])
        atomic_write_json(out / "curve.json", state["curve"])
        _plot(state["curve"], out / "curve.png")
        if point["tau"] > state["best_tau"]:
            state["best_tau"] = point["tau"]
            state["best_step"] = state["step"]
            _save_best(out, head)

    stop = {"term": False}
    previous = signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("term", True)) \
        if sys.gettrace() is None else None
    if not state["curve"]:
        evaluate()
    n = train["tokens"].shape[0]
    gen = torch.Generator().manual_seed(config.seed + state["step"])
    budget = config.minutes * 60
    last_eval = state["elapsed_s"]
    weights = [config.ttt_decay ** s for s in range(config.ttt_steps)]
    log_file = open(out / "train_log.jsonl", "a")
    head.train()
    stopped_by = "minutes"
    try:
        while state["elapsed_s"] < budget:
            if stop["term"]:
                stopped_by = "sigterm"
                break
            t0 = time.perf_counter()
            idx = torch.randint(0, n, (config.batch_size,), generator=gen)
            f, t, m = train["features"][idx].float(), train["tokens"][idx], train["mask"][idx]
            valid = m[:, 1:].float()
            progress_frac = state["elapsed_s"] / budget
            lr = config.lr * min(1.0, (state["step"] + 1) / config.warmup_steps) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_frac)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, parts = head_loss(head, f, t, valid, weights, config.reg_weight, std, config.autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            dt = time.perf_counter() - t0
            state["step"] += 1
            state["elapsed_s"] += dt
            state["tokens"] += int(valid.sum())
            log_file.write(json.dumps({"step": state["step"], "loss": round(float(loss), 4), "kl": parts, "lr": lr,
                                       "tokens": state["tokens"], "tokens_per_s": round(valid.sum().item() / dt, 1),
                                       "elapsed_s": round(state["elapsed_s"], 1)}) + "\n")
            log_file.flush()
            if progress and state["step"] % 10 == 0:
                print(f"step {state['step']} tokens {state['tokens']} loss {float(loss):.3f} kl {parts} "
                      f"{valid.sum().item() / dt:.0f} tok/s {state['elapsed_s'] / 60:.1f} min", file=sys.stderr,
                      flush=True)
            if state["elapsed_s"] - last_eval >= config.eval_every_minutes * 60:
                evaluate()
                _save_checkpoint(out, head, snapshot())
                last_eval = state["elapsed_s"]
    finally:
        log_file.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    evaluate()
    _save_checkpoint(out, head, snapshot())
    summary = {"stopped_by": stopped_by, "steps": state["step"], "tokens": state["tokens"],
               "minutes": state["elapsed_s"] / 60, "best_step": state.get("best_step"),
               "best_tau": state["best_tau"], "curve": state["curve"], "data": data["manifest"] | {
                   "heldout_prompts": len(data["manifest"].get("heldout_prompts", []))},
               "config": dataclasses.asdict(config) | {"out": str(out)}}
    atomic_write_json(out / "summary.json", summary)
    return summary
