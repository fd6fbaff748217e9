"""The kit's correctness stages: greedy identity to HF ``generate`` per decoding path, a quick sampling chi-square,
and every KV policy on the device against the same policy on the CPU.

Each stage takes the run's :class:`~gpu_kit.context.Kit` and returns a JSON-able dict; a check that fails is a row
with ``ok: false`` and the first divergent token, not an exception (the next check still runs).
"""

from __future__ import annotations

import copy

import torch

from gpu_kit import shapes
from toolkit.engine.decoder import SpeculativeDecoder
from toolkit.engine.forward import TargetForward
from toolkit.engine.planner import ConstantK, CostAwareK
from toolkit.kv import make_policy
from toolkit.measure.baselines import hf_generate
from toolkit.recipe import GenerationSpec, KVSpec
from toolkit.speculative.cost_model import VerifyCost
from toolkit.speculative.drafters import DraftModel, LookupDrafter
from toolkit.speculative.drafters.eagle import EagleDrafter
from toolkit.speculative.stats import GenerationStats
from toolkit.speculative.tree import TreeShape
from toolkit.speculative.verify_length import Calibrator


def hf_greedy(model, ids: torch.Tensor, new: int) -> list[int]:
    """HF ``generate(do_sample=False)``, EOS disabled (the toolkit's AR baseline): the reference every path must
    equal."""
    return hf_generate(model, ids, GenerationSpec(max_new_tokens=new, ignore_eos=True), [], method="ar")[0]


def ours(target, drafter, ids: torch.Tensor, new: int, controller=None, policy=None, tree=None, forward=None,
         **gen) -> tuple[list[int], GenerationStats]:
    """Our decoder on one sequence to ``new`` tokens (EOS ignored), eager or on ``forward`` (a compiled
    :class:`~toolkit.engine.forward.TargetForward`); returns the new ids and the stats."""
    from toolkit.speculative.drafters import RowDrafter, RowDrafters

    stats = GenerationStats()
    if drafter is not None and not isinstance(drafter, RowDrafter):  # a single-sequence drafter: one row
        drafter = RowDrafters(lambda: drafter)
    loop = SpeculativeDecoder(target, drafter, controller or ConstantK(4), policy, tree, forward=forward)
    spec = GenerationSpec(max_new_tokens=new, ignore_eos=True, **gen)
    with torch.no_grad():
        return [t for chunk in loop.decode(ids, spec, stats) for t in chunk], stats


def ours_batch(target, drafter_maker, prompts: list, new: int, controller=None, forward=None, batch_size: int = 8):
    """Our decoder over ``batch_size`` rows (continuous batching), a drafter from ``drafter_maker()`` per row (or a
    row drafter serving every row); returns ``[(new ids, stats)]`` in input order."""
    from toolkit.speculative.drafters import RowDrafter, RowDrafters

    controller = controller or CostAwareK(VerifyCost([1.0] * 64, learn=False), Calibrator(), 4, 5)
    drafter = drafter_maker if isinstance(drafter_maker, RowDrafter) and not isinstance(drafter_maker, type) \
        else RowDrafters(drafter_maker)
    loop = SpeculativeDecoder(target, drafter, controller, forward=forward, batch_size=batch_size)
    with torch.no_grad():
        return loop.decode_batch(prompts, GenerationSpec(max_new_tokens=new, ignore_eos=True))


def compiled_forward(kit, target) -> TargetForward:
    """The target on the compiled static engine the way the device runs it (:meth:`Kit.compiled`: one per model)."""
    return kit.compiled(target)


def compare(got: list[int], reference: list[int]) -> dict:
    """``{"ok", "first_divergence"}``: the first index where ``got`` differs from ``reference`` (None if equal)."""
    first = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
    if first is None and len(got) != len(reference):
        first = min(len(got), len(reference))
    return {"ok": first is None, "first_divergence": first}


def eagle_head(target, seed: int = 0):
    """An EAGLE-1 head built for ``target`` on its device and dtype (untrained: greedy identity does not depend on
    its quality); :class:`~toolkit.speculative.drafters.eagle.EagleDrafter` drafts with it."""
    from toolkit.distill.eagle_init import build_head

    vocab = target.config.vocab_size
    head = build_head(target, min(vocab, 4096), torch.ones(vocab, dtype=torch.float64), seed=seed)
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def greedy_identity(kit) -> dict:
    """Every decoding path on the device, token-identical to HF greedy on the same weights (fp32)."""
    target = kit.model("check" if not kit.dry_run else "tiny", torch.float32)
    draft = kit.model("tiny-draft" if kit.dry_run else "draft-68m", torch.float32, seed=1)
    new = kit.new_tokens
    prompts = [p.to(kit.device) for p in shapes.prompts(kit.tokenizer, 8, kit.prompt_tokens)]
    reference = [hf_greedy(target, p, new) for p in prompts]
    rows = []

    def check(name, run, prompt_index=0):
        got, stats = run(prompts[prompt_index])
        rows.append({"path": name, **compare(got, reference[prompt_index]), "tau": round(stats.tokens_per_round, 3)})

    cost = CostAwareK(VerifyCost([1.0] * 64, learn=False), Calibrator(), 8, 9)
    check("AR (no drafter)", lambda p: ours(target, None, p, new))
    check("lookup, K=4", lambda p: ours(target, LookupDrafter(max_cached_requests=0), p, new))
    check("lookup, cost-aware K", lambda p: ours(target, LookupDrafter(max_cached_requests=0), p, new, cost))
    check("draft model, K=4", lambda p: ours(target, DraftModel(draft), p, new))
    check("EAGLE-1 head, K=3", lambda p: ours(target, EagleDrafter(target, eagle_head(target)), p, new, ConstantK(3)))
    check("draft-model tree (budget 8, depth 4, top-k 2)",
          lambda p: ours(target, DraftModel(draft), p, new, tree=TreeShape(8, 4, 2)))
    batch = ours_batch(target, lambda: LookupDrafter(max_cached_requests=0), prompts, new)
    for i, (ids, _) in enumerate(batch):
        rows.append({"path": f"batch of 8, lookup: row {i}", **compare(ids, reference[i]), "tau": None})
    label = "CUDA graphs" if kit.device.type == "cuda" else f"compiled ({kit.compile_backend})"
    if kit.compile_backend != "none":
        forward = compiled_forward(kit, target)
        check(f"AR, {label}", lambda p: ours(target, None, p, new, forward=forward))
        check(f"lookup, cost-aware K, {label}",
              lambda p: ours(target, LookupDrafter(max_cached_requests=0), p, new, cost, forward=forward))
        batch = ours_batch(target, lambda: LookupDrafter(max_cached_requests=0), prompts, new, forward=forward)
        for i, (ids, _) in enumerate(batch):
            rows.append({"path": f"batch of 8, lookup, {label}: row {i}", **compare(ids, reference[i]),
                         "tau": None})
    real = kit.embedded
    if real is not None:
        model, tok = real
        for i, p in enumerate(shapes.prompts(tok, 2, kit.prompt_tokens)):
            p = p.to(kit.device)
            want = hf_greedy(model, p, new)
            got, stats = ours(model, LookupDrafter(max_cached_requests=0), p, new)
            rows.append({"path": f"embedded SmolLM2 (real weights), lookup: prompt {i}", **compare(got, want),
                         "tau": round(stats.tokens_per_round, 3)})
            if kit.compile_backend != "none" and not kit.dry_run:  # the dry run traces the engine on "tiny" only
                got, stats = ours(model, LookupDrafter(max_cached_requests=0), p, new,
                                  forward=compiled_forward(kit, model))
                rows.append({"path": f"embedded SmolLM2 (real weights), lookup, {label}: prompt {i}",
                             **compare(got, want), "tau": round(stats.tokens_per_round, 3)})
    return {"rows": rows, "all_identical": all(r["ok"] for r in rows if r["ok"] is not None)}


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (``scipy.stats.chisquare``) of ``counts`` (k,) against ``expected_probs`` (k,),
    cells of expected count < 5 pooled into one."""
    from scipy.stats import chisquare

    expected = expected_probs.double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    expected = expected * (counts.sum() / expected.sum())  # scipy wants equal totals to 1e-8
    return float(chisquare(counts.double().numpy(), expected.numpy()).pvalue)


def sampling(kit) -> dict:
    """Speculative sampling reproduces the target: the second new token (the first one a speculative round commits:
    a draft model samples 3 tokens from q at temperature 1, the target accepts or resamples) follows
    ``sum_x1 p(x1) p(x2 | x1)`` on a 16-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    target = LlamaForCausalLM(config).to(kit.device).eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.3 * param.std().clamp_min(1e-3))
    prompt = torch.tensor([[1, 5, 9, 3]], device=kit.device)
    with torch.no_grad():
        p1 = target(prompt).logits[0, -1].float().softmax(-1)
        rows = torch.cat([prompt.repeat(16, 1), torch.arange(16, device=kit.device).view(-1, 1)], 1)
        p2 = target(rows).logits[:, -1].float().softmax(-1)
    expected = (p1[:, None] * p2).sum(0).cpu()
    counts = torch.zeros(16)
    draws = kit.sampling_draws
    drafted = 0
    for seed in range(draws):  # 5 new tokens: the round after the prefill has room for all 3 draft tokens
        drafter = DraftModel(draft, do_sample=True,
                             generator=torch.Generator(device=kit.device).manual_seed(10_000 + seed))
        got, stats = ours(target, drafter, prompt, 5, ConstantK(3), do_sample=True, temperature=1.0, seed=seed)
        counts[got[1]] += 1
        drafted += stats.drafted
    if not drafted:
        raise RuntimeError("the sampling stage drafted nothing: it would not test speculative sampling")
    p_value = chi_square_p(counts, expected)
    return {"draws": draws, "drafted": drafted, "p_value": p_value, "ok": p_value > 0.01,
            "test": "chi-square of the 2nd new token vs sum_x1 p(x1) p(x2|x1), V = 16, draft model K = 3"}


def policies(total: int, kv_heads: int, layers: int) -> dict:
    """The KV policies run on the device and on the CPU, with budgets of half the ``total`` tokens (prompt + new),
    so each one compresses during the generation."""
    half = max(total // 2, 12)
    return {
        "streaming": {"sink_tokens": 4, "window": half, "compress_interval": 4},
        "l2norm": {"budget": half, "protect_recent": 4, "skip_layers": [0], "compress_interval": 4},
        "head_aware": {"budget": half, "protect_recent": 4, "skip_layers": [0], "tiers": 2, "compress_interval": 4,
                       "importance": [[1.0 - 0.5 * h / kv_heads for h in range(kv_heads)]] * layers},
        "quantized": {"quant_bits": 4, "quant_group_size": 8, "residual_length": 8, "sink_tokens": 4},
    }


def kv_policies(kit) -> dict:
    """Each KV policy with the lookup drafter: greedy tokens on the device == the same policy on the CPU."""
    device_model = kit.model("tiny" if kit.dry_run else "check", torch.float32)
    cpu_model = copy.deepcopy(device_model).to("cpu")
    prompt = shapes.prompts(kit.tokenizer, 1, kit.prompt_tokens)[0]
    config = device_model.config
    rows = []
    for name, params in policies(kit.prompt_tokens + kit.new_tokens, config.num_key_value_heads,
                                 config.num_hidden_layers).items():
        on_device, stats = ours(device_model, LookupDrafter(max_cached_requests=0), prompt.to(kit.device),
                                kit.new_tokens, policy=make_policy(KVSpec(name, params)))
        on_cpu, _ = ours(cpu_model, LookupDrafter(max_cached_requests=0), prompt, kit.new_tokens,
                         policy=make_policy(KVSpec(name, params)))
        rows.append({"policy": name, **compare(on_device, on_cpu), "compressions": stats.compressions_target,
                     "kv_bytes": stats.kv_bytes_target})
    return {"rows": rows, "all_equal": all(r["ok"] for r in rows)}
