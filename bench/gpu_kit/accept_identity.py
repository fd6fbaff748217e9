"""Stage ``accept_identity``: greedy identity of every speculative path **with drafts accepted** (τ > 1.5 on each row).

The first kit's ``greedy`` stage compared each path with HF ``generate`` on a random-weight model, where no draft is
ever accepted (τ = 1.0 on every random row): the paths' verify, accept and rollback code ran only on rejections. Here
every path drafts for a target it agrees with, by construction:

* **a cycle target** (:func:`agreeing_target`): the kit's ``check`` shape (fp32, peaked logits) with its LM head
  rebuilt so that the residual stream of token ``x`` scores ``succ(x)`` highest, ``succ`` a fixed permutation of the
  vocabulary made of cycles of 8 tokens, and its decoder layers scaled by a factor ``mix`` bisected so that the
  greedy output leaves the cycle on a few percent of positions (so drafts are both accepted and rejected). The
  lookup drafter finds each cycle in the text once it went round; an EAGLE-1 head whose ``fc`` passes the token
  embedding through (:func:`agreeing_head`) predicts ``succ`` of each token it reads; a draft model that is the
  target itself drafts exactly; a perturbed copy (weights + 5 % noise) nearly so.
* **the real embedded model** (when relayed): it drafts for itself (a draft model that is the target).

Every row must be token-identical to HF greedy ``generate`` on the same weights **and** reach τ > :data:`MIN_TAU`;
:func:`failures` lists the rows that do not, and the stage raises ``AssertionError`` naming them after saving every
row. Rows: lookup (K = 4, cost-aware), draft model (itself, perturbed), EAGLE-1 head (chain and tree), draft-model
tree, a batch of 8 per batch drafter (lookup per row, the batched draft model, the batched EAGLE head; τ per row),
each on the compiled engine as well (CUDA graphs on a GPU).
"""

from __future__ import annotations

import copy
import math

import torch

from gpu_kit import shapes
from gpu_kit.checks import compare, hf_greedy, ours, ours_batch
from toolkit.engine.planner import ConstantK, CostAwareK
from toolkit.quant.block_embedding import embedding_table
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter
from toolkit.speculative.drafters.eagle import EagleDrafter
from toolkit.speculative.tree import TreeShape
from toolkit.speculative.verify_length import Calibrator

#: every asserted row must commit more than this many tokens per round (AR commits 1.0)
MIN_TAU = 1.5
#: tokens per cycle of the cycle target's successor permutation
CYCLE = 8
#: the fraction of positions where the cycle target's greedy output leaves its cycle (bisected into this range)
DEVIATION = (0.02, 0.08)


def cycle_successor(vocab: int, length: int = CYCLE, seed: int = 0) -> torch.Tensor:
    """``succ`` ``(vocab,)`` int64: a permutation of ``0 .. vocab - 1`` made of cycles of ``length`` tokens (the
    last one shorter when ``length`` does not divide ``vocab``), each cycle a random set of tokens."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    succ = torch.empty(vocab, dtype=torch.long)
    for start in range(0, vocab, length):
        members = order[start:start + length]
        succ[members] = torch.roll(members, -1)
    return succ


def _cycle_copy(model, succ: torch.Tensor, mix: float):
    """A copy of ``model`` whose LM head row ``succ[x]`` is token ``x``'s embedding (so ``x`` alone scores
    ``succ[x]`` highest) and whose decoder layers' output projections are scaled by ``mix``."""
    target = copy.deepcopy(model)
    with torch.no_grad():
        embed = embedding_table(target.get_input_embeddings())  # a GGUF block embedding's rows dequantized
        head = torch.empty_like(embed)
        head[succ.to(embed.device)] = embed
        target.get_output_embeddings().weight = torch.nn.Parameter(head, requires_grad=False)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(mix)
            layer.mlp.down_proj.weight.mul_(mix)
    return target


def cycle_prompts(succ: torch.Tensor, count: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` prompts ``(1, length)`` that follow the cycles (``x[i + 1] = succ[x[i]]``) from random starts: the
    lookup drafter finds its continuation in the prompt from the first round."""
    starts = torch.randint(0, succ.numel(), (count,), generator=torch.Generator().manual_seed(seed))
    out = []
    for start in starts.tolist():
        ids = [start]
        for _ in range(length - 1):
            ids.append(int(succ[ids[-1]]))
        out.append(torch.tensor([ids]))
    return out


def deviation(target, succ: torch.Tensor, prompt: torch.Tensor, new: int) -> float:
    """The fraction of ``new`` greedy tokens of ``target`` after ``prompt`` ``(1, n)`` that are not ``succ`` of the
    token before them."""
    out = hf_greedy(target, prompt, new)
    before = [int(prompt[0, -1])] + out[:-1]
    return sum(t != int(succ[b]) for t, b in zip(out, before)) / len(out)


def agreeing_target(model, succ: torch.Tensor, prompt: torch.Tensor, new: int, steps: int = 8):
    """``(target, mix, deviation)``: the cycle target of ``model`` (see the module docstring) with ``mix`` bisected
    on a log scale in [1e-5, 1] until its greedy output after ``prompt`` leaves the cycle on a fraction of positions
    inside :data:`DEVIATION` (the last one tried when ``steps`` bisections do not get there)."""
    low, high = math.log(1e-5), 0.0
    best = None
    for _ in range(steps):
        mix = math.exp((low + high) / 2)
        target = _cycle_copy(model, succ, mix)
        dev = deviation(target, succ, prompt, new)
        best = (target, mix, dev)
        if dev < DEVIATION[0]:
            low = math.log(mix)
        elif dev > DEVIATION[1]:
            high = math.log(mix)
        else:
            break
    return best


def agreeing_head(target):
    """An EAGLE-1 head over the whole vocabulary whose ``fc`` passes the next token's embedding through (the
    feature input weighted 0): on a cycle target it drafts ``succ`` of every token it reads."""
    from toolkit.distill.eagle_init import build_head

    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    head = build_head(target, vocab, torch.ones(vocab, dtype=torch.float64), seed=0)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        if head.fc.bias is not None:
            head.fc.bias.zero_()
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def perturbed(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with every weight plus Gaussian noise of ``scale`` x that weight's standard deviation."""
    draft = copy.deepcopy(model)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            noise = torch.randn(param.shape, generator=gen).to(param.device, param.dtype)
            param.add_(noise * scale * param.float().std().clamp_min(1e-6).to(param.dtype))
    return draft


def failures(rows: list[dict], min_tau: float = MIN_TAU) -> list[str]:
    """``"path: why"`` for each row that is not token-identical or whose τ is not above ``min_tau`` (a row
    without a τ fails: acceptance was not measured)."""
    out = []
    for row in rows:
        if not row["ok"]:
            out.append(f"{row['path']}: differs from HF greedy at token {row['first_divergence']}")
        elif row.get("tau") is None or not row["tau"] > min_tau:
            out.append(f"{row['path']}: tau {row.get('tau')} <= {min_tau} (drafts were not accepted enough)")
    return out


def _row(path: str, got: list[int], reference: list[int], stats, agree: str) -> dict:
    return {"path": path, **compare(got, reference), "tau": round(stats.tokens_per_round, 3),
            "alpha": round(stats.acceptance_rate, 3), "rounds": stats.rounds, "drafts": agree}


def _single_paths(target, draft, head, cost) -> dict:
    """``{path: (run(prompt, new, forward) -> (ids, stats), how drafts agree)}`` of the single-sequence paths."""
    return {
        "lookup, K=4": (lambda p, n, f: ours(target, LookupDrafter(max_cached_requests=0), p, n, forward=f),
                        "cycles of the text"),
        "lookup, cost-aware K": (lambda p, n, f: ours(target, LookupDrafter(max_cached_requests=0), p, n, cost,
                                                      forward=f), "cycles of the text"),
        "draft model = target, K=4": (lambda p, n, f: ours(target, DraftModel(target), p, n, forward=f),
                                      "the target itself"),
        "draft model = perturbed copy, K=4": (lambda p, n, f: ours(target, DraftModel(draft), p, n, forward=f),
                                              "5 % weight noise"),
        "EAGLE-1 head, K=3": (lambda p, n, f: ours(target, EagleDrafter(target, head), p, n, ConstantK(3),
                                                   forward=f), "head passes the token through"),
        "draft-model tree (budget 8, depth 4, top-k 2)": (
            lambda p, n, f: ours(target, DraftModel(draft), p, n, tree=TreeShape(8, 4, 2)), "5 % weight noise"),
        "EAGLE-1 tree (budget 8, depth 4, top-k 2)": (
            lambda p, n, f: ours(target, EagleDrafter(target, head), p, n, tree=TreeShape(8, 4, 2)),
            "head passes the token through"),
    }


def _batch_paths(target, draft, head) -> dict:
    return {"lookup per row": (lambda: LookupDrafter(max_cached_requests=0), "cycles of the text"),
            "batched draft model (perturbed copy)": (DraftModel(draft), "5 % weight noise"),
            "batched EAGLE-1 head": (EagleDrafter(target, head), "head passes the token through")}


def _batch_rows(rows: list, target, maker, prompts: list, new: int, reference: list, forward, label: str, name: str,
                agree: str) -> None:
    """One batched path over every prompt, eager and (where there is one) on the compiled forward: a row each."""
    for where, fwd in (("eager", None), (label, forward)):
        if where != "eager" and fwd is None:
            continue
        results = ours_batch(target, maker, prompts, new, ConstantK(4), forward=fwd, batch_size=len(prompts))
        for i, (ids, stats) in enumerate(results):
            rows.append(_row(f"batch of {len(prompts)}, {name}, {where}: row {i}", ids, reference[i], stats, agree))


def accept_identity(kit) -> dict:
    """Every speculative path on a cycle target (and the real model when relayed), identical to HF greedy with
    τ > :data:`MIN_TAU` per row; raises ``AssertionError`` naming the rows that are not (the rows are saved first).
    A stage cap (``--stage-s accept_identity=S``) stops it between paths: ``out["cut"]`` says before which."""
    base = kit.model("tiny" if kit.dry_run else "check", torch.float32)
    new = max(kit.new_tokens, 24) if kit.dry_run else 64
    rows_n = 4 if kit.dry_run else 8
    succ = cycle_successor(base.config.vocab_size)
    prompts = [p.to(kit.device) for p in cycle_prompts(succ, rows_n, kit.prompt_tokens)]
    target, mix, dev = agreeing_target(base, succ, prompts[0], new)
    kit.log(f"cycle target: layers x {mix:.2e}, greedy leaves the cycle on {dev:.1%} of positions")
    draft, head = perturbed(target), agreeing_head(target)
    reference = [hf_greedy(target, p, new) for p in prompts]
    cost = CostAwareK(VerifyCost([1.0] * 64, learn=False), Calibrator(), 8, 9)
    out = {"target": {"shape": "tiny" if kit.dry_run else "check", "mix": mix, "deviation": dev,
                      "new_tokens": new, "cycle": CYCLE}, "rows": []}
    rows = out["rows"]
    label = "CUDA graphs" if kit.device.type == "cuda" else f"compiled ({kit.compile_backend})"
    forward = kit.compiled(target) if kit.compile_backend != "none" else None
    paths = [("single", name, run, agree) for name, (run, agree) in _single_paths(target, draft, head, cost).items()]
    paths += [("batch", name, maker, agree) for name, (maker, agree) in _batch_paths(target, draft, head).items()]
    for kind, name, run, agree in paths:
        if kit.out_of_time(f"accept_identity: {name}"):
            out["cut"] = f"the stage's time ran out before '{name}'"
            break
        if kind == "batch":
            _batch_rows(rows, target, run, prompts, new, reference, forward, label, name, agree)
            kit.partial("accept_identity", out)
            continue
        got, stats = run(prompts[0], new, None)
        rows.append(_row(name, got, reference[0], stats, agree))
        if forward is not None and "tree" not in name:
            got, stats = run(prompts[0], new, forward)
            rows.append(_row(f"{name}, {label}", got, reference[0], stats, agree))
        kit.partial("accept_identity", out)
    if "cut" not in out:
        rows.extend(_real_rows(kit, new))
    out["failures"] = failures(rows)
    out["all_ok"] = not out["failures"]
    kit.partial("accept_identity", out)
    if out["failures"]:
        raise AssertionError(f"{len(out['failures'])} of {len(rows)} rows fail: " + "; ".join(out["failures"]))
    return out


def _real_rows(kit, new: int) -> list[dict]:
    """The real embedded model drafting for itself (draft model = target, K = 4), eager and on the compiled engine,
    two prompts of the kit's suite; none when the model was not relayed or in the dry run."""
    real = None if kit.dry_run else kit.embedded  # (the dry run: a 135M model drafting for itself is minutes on a CPU)
    if real is None:
        return []
    model, tok = real
    rows = []
    forward = kit.compiled(model) if kit.compile_backend != "none" and not kit.dry_run else None
    for i, prompt in enumerate(shapes.prompts(tok, 2, kit.prompt_tokens)):
        prompt = prompt.to(kit.device)
        want = hf_greedy(model, prompt, new)
        for where, fwd in (("eager", None), ("compiled", forward)):
            if where != "eager" and fwd is None:
                continue
            got, stats = ours(model, DraftModel(model), prompt, new, forward=fwd)
            rows.append(_row(f"embedded SmolLM2, draft model = target, {where}: prompt {i}", got, want, stats,
                             "the target itself"))
    return rows
