"""Metrics of a recipe: perplexity (through the configured cache, and sliding-window), acceptance, memory, fidelity.

Every function here is pure measurement on already-loaded models; orchestration lives in :mod:`eval.evaluate`.
Units: bytes, milliseconds, tokens; perplexities use natural logs, normalized per predicted token.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from toolkit.kv.contract import new_cache, policy_attached
from toolkit.models.llamacpp import is_llamacpp


# ------------------------------------------------------------------------------------------------------ perplexity
def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -log p(target) over rows of ``logits`` ``(n, vocab)`` (computed in float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp.gather(1, targets.view(-1, 1)).sum())


@torch.no_grad()
def perplexity_through_cache(model, ids: list[int], policy=None, chunk: int = 5, progress: bool = False) -> dict:
    """Teacher-forced perplexity of ``ids`` fed through ``model``'s cache in chunks of ``chunk`` tokens (K + 1).

    This is the perplexity the recipe's target actually has during generation: the cache is the one the decoder
    builds for one row (:func:`toolkit.kv.rows.rows_cache`: the policy's static form where it has one, else its
    single-sequence cache), the first chunk is prefilled as a prompt is, every later chunk is one forward as a verify
    forward of K + 1 tokens is, and each is accepted whole and followed by a commit point (where a policy
    compresses).

    Protocol: token 0 is context only; tokens 1..n-1 are predicted (``n - 1`` predictions), each from everything the
    cache holds at that point; PPL = exp(sum NLL / (n - 1)), natural log.

    Returns a dict with ``value``, ``nll_sum``, ``tokens`` (predicted), ``peak_kv_bytes`` (the most the cache held:
    ``needed_bytes``), ``allocated_kv_bytes`` (a static form's buffers), ``protocol``.

    Raises:
        ValueError: fewer than 2 tokens, or ``chunk`` < 1.
    """
    from toolkit.engine.forward import TargetForward
    from toolkit.kv.rows import rows_cache
    from toolkit.kv.static import StaticKV, capacity_for

    if len(ids) < 2:
        raise ValueError("ids: perplexity needs at least 2 tokens")
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    if is_llamacpp(model):
        return _through_llamacpp(model, ids, policy, chunk)
    seq = torch.tensor([ids], device=next(model.parameters()).device)
    n = seq.shape[1]
    forward = TargetForward(model)  # eager: the same cache and attention as the decoder's, one chunk at a time
    cache = rows_cache(policy, model, 1, capacity_for(n + chunk), chunk)
    attention = forward.attached() if isinstance(cache, StaticKV) else policy_attached(policy, model)
    starts = range(0, n - 1, chunk)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"ppl through cache (chunk {chunk})", unit="fwd", leave=False)
    nll, count, peak_kv = 0.0, 0, 0
    with attention:
        for start in starts:
            logits = _chunk_logits(model, forward, cache, seq[:, start:start + chunk], first=start == 0)
            targets = seq[0, start + 1:start + chunk + 1]
            nll += nll_sum(logits[0, : targets.shape[0]], targets)
            count += targets.shape[0]
            peak_kv = max(peak_kv, cache.needed_bytes())
    return {
        "value": math.exp(nll / count), "nll_sum": nll, "tokens": count, "peak_kv_bytes": peak_kv,
        "allocated_kv_bytes": cache.kv_bytes(),
        "protocol": {"method": "teacher-forced through the recipe's KV cache", "chunk_tokens": chunk,
                     "text_tokens": n, "predicted_tokens": count, "normalization": "token-level, natural log",
                     "kv_policy": getattr(policy, "name", "none") if policy is not None else "none",
                     "cache": type(cache).__name__},
    }


def _chunk_logits(model, forward, cache, tokens: torch.Tensor, first: bool) -> torch.Tensor:
    """Logits ``(1, q, vocab)`` of one chunk ``tokens`` ``(1, q)`` through ``cache``: the first chunk prefilled as a
    prompt is, a later one as a verify forward accepted whole; then the commit point."""
    from toolkit.engine.forward import model_kwargs

    q = tokens.shape[1]
    if first:
        prefilled, kwargs = cache.begin_row(q)
        logits = model(input_ids=tokens, use_cache=True, **model_kwargs(model, kwargs)).logits
        cache.add_row(prefilled, q)
    else:
        logits = forward(cache, tokens)
        cache.accept(torch.full((1,), q, device=tokens.device), [q])
    cache.commit()
    return logits


@torch.no_grad()
def perplexity_sliding_window(model, ids: list[int], window: int = 1024, stride: int = 512,
                              progress: bool = False) -> dict:
    """Standard sliding-window perplexity (HF "Perplexity of fixed-length models") of an uncompressed model (a
    llama.cpp target: each window a fresh llama.cpp sequence, logits at every position).

    Windows of ``window`` tokens start every ``stride`` tokens; each window scores only the tokens not scored by an
    earlier window (so every token 1..n-1 is scored once, with at least ``window - stride`` tokens of context
    after the first window). Exact token-level normalization: PPL = exp(sum NLL / (n - 1)).
    """
    if len(ids) < 2:
        raise ValueError("ids: perplexity needs at least 2 tokens")
    if not 1 <= stride <= window:
        raise ValueError(f"stride: must be in [1, window={window}], got {stride}")
    device = next(model.parameters()).device
    seq = torch.tensor([ids], device=device)
    n = seq.shape[1]
    run = _llamacpp_window(model) if is_llamacpp(model) else \
        (lambda tokens: model(input_ids=tokens, use_cache=False).logits[0])
    nll, count, scored_until = 0.0, 0, 1  # next absolute index to score (token 0 is never predicted)
    begins = list(range(0, n, stride))
    if progress:
        from tqdm.auto import tqdm

        begins = tqdm(begins, desc=f"ppl sliding window {window}/{stride}", unit="win", leave=False)
    for begin in begins:
        end = min(begin + window, n)
        logits = run(seq[:, begin:end])
        first = max(scored_until, begin + 1)
        if first < end:
            targets = seq[0, first:end]
            nll += nll_sum(logits[first - begin - 1:end - begin - 1], targets)
            count += targets.shape[0]
            scored_until = end
        if end == n:
            break
    return {
        "value": math.exp(nll / count), "nll_sum": nll, "tokens": count,
        "protocol": {"method": "sliding window, uncompressed model", "window": window, "stride": stride,
                     "text_tokens": n, "predicted_tokens": count, "normalization": "token-level, natural log"},
    }


def _through_llamacpp(model, ids: list[int], policy, chunk: int) -> dict:
    """:func:`perplexity_through_cache` of a llama.cpp target (``target.backend: llama.cpp``): the same chunks of
    ``chunk`` tokens, each one forward of the decoder's llama.cpp forward with logits at every position, on its cache
    under the KV policy's llama.cpp form (StreamingLLM shifts at the commit after each chunk)."""
    from toolkit.engine.llamacpp_forward import LlamaCppForward

    forward = LlamaCppForward(model, policy)
    cache = forward.cache_for(policy, 1, len(ids), chunk)
    cache.begin_row(0)
    nll, count, peak_kv = 0.0, 0, 0
    seq = torch.tensor([ids])
    for start in range(0, len(ids) - 1, chunk):
        tokens = seq[:, start:start + chunk]
        logits = forward(cache, tokens)[0]
        cache.accept(None, [tokens.shape[1]])
        cache.commit()
        targets = seq[0, start + 1:start + tokens.shape[1] + 1]
        nll += nll_sum(logits[: targets.shape[0]], targets)
        count += targets.shape[0]
        peak_kv = max(peak_kv, cache.kv_bytes())
    cache.keep_rows([])
    form = forward.form
    return {
        "value": math.exp(nll / count), "nll_sum": nll, "tokens": count, "peak_kv_bytes": peak_kv,
        "protocol": {"method": "teacher-forced through the recipe's KV cache on llama.cpp", "chunk_tokens": chunk,
                     "text_tokens": len(ids), "predicted_tokens": count, "normalization": "token-level, natural log",
                     "kv_policy": getattr(policy, "name", "none") if policy is not None else "none",
                     "llama_cpp_cache": f"{form.type_k}/{form.type_v}"},
    }


def _llamacpp_window(model):
    """``tokens (1, n) -> logits (n, vocab)`` of a llama.cpp target over a fresh sequence (positions from 0), in
    forwards of up to ``N_BATCH`` tokens: the sliding window's forward."""
    from toolkit.engine.llamacpp_forward import LlamaCppForward
    from toolkit.models.llamacpp import N_BATCH

    forward = LlamaCppForward(model)

    def run(tokens: torch.Tensor) -> torch.Tensor:
        cache = forward.cache_for(None, 1, tokens.shape[1], N_BATCH)
        cache.begin_row(0)
        out = []
        for start in range(0, tokens.shape[1], N_BATCH):
            piece = tokens[:, start:start + N_BATCH]
            out.append(forward(cache, piece)[0])
            cache.accept(None, [piece.shape[1]])
        cache.keep_rows([])
        return torch.cat(out)

    return run


# ------------------------------------------------------------------------------------------------------ acceptance
from toolkit.speculative.stats import acceptance_summary as acceptance  # noqa: E402,F401  (one summary, re-exported)
from toolkit.speculative.stats import check_acceptance  # noqa: E402,F401


# ------------------------------------------------------------------------------------------------------ fidelity
def fidelity(ids: list[int], reference: list[int]) -> dict:
    """Token agreement of ``ids`` with a ``reference`` greedy output of the same prompt.

    ``match_rate``: positions i < len(reference) with ids[i] == reference[i], over len(reference);
    ``first_divergence``: first differing position (``None`` when identical); ``prefix_match``: the matching prefix
    length over len(reference).
    """
    n = len(reference)
    if n == 0:
        return {"match_rate": 1.0, "first_divergence": None, "prefix_match": 1.0, "compared_tokens": 0}
    matches = sum(1 for a, b in zip(ids, reference) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), None)
    if first is None and len(ids) != n:
        first = min(len(ids), n)
    prefix = n if first is None else first
    return {"match_rate": matches / n, "first_divergence": first, "prefix_match": prefix / n, "compared_tokens": n}


def fidelity_summary(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """:func:`fidelity` over several prompts: token-weighted match rate, per-prompt first divergences."""
    each = [fidelity(a, b) for a, b in pairs]
    total = sum(e["compared_tokens"] for e in each)
    return {
        "match_rate": sum(e["match_rate"] * e["compared_tokens"] for e in each) / total if total else 1.0,
        "prefix_match": sum(e["prefix_match"] * e["compared_tokens"] for e in each) / total if total else 1.0,
        "first_divergence": [e["first_divergence"] for e in each],
        "identical": all(e["first_divergence"] is None for e in each),
        "compared_tokens": total,
    }


# ------------------------------------------------------------------------------------------------------ memory
def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    """Context manager measuring the peak device memory of a block.

    CUDA: ``torch.cuda.reset_peak_memory_stats`` on entry, ``max_memory_allocated`` / ``max_memory_reserved`` on
    exit (growth = peak allocated minus allocated at entry). CPU: the process's peak RSS during the block, from
    the kernel's VmHWM after resetting it (Linux ``/proc/self/clear_refs``), else sampled every 2 ms with psutil;
    growth = peak RSS minus RSS at entry (>= 0; the allocator may reuse memory freed by earlier runs).
    """

    device: str = "cpu"

    def __enter__(self) -> PeakMemory:
        self.result: dict = {}
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._proc = psutil.Process(os.getpid())
        self._base = self._proc.memory_info().rss
        self._hwm = _reset_peak_rss() and _read_status("VmHWM") is not None
        self._peak = self._base
        if not self._hwm:
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._peak = max(self._peak, self._proc.memory_info().rss)
                    time.sleep(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self.result = {"device": "cuda", "peak_allocated_bytes": int(peak),
                           "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                           "peak_growth_bytes": int(max(0, peak - self._base))}
            return
        if self._hwm:
            self._peak = max(self._peak, _read_status("VmHWM") or 0)
        else:
            self._stop.set()
            self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.result = {"device": "cpu", "peak_rss_bytes": int(self._peak),
                       "peak_rss_growth_bytes": int(max(0, self._peak - self._base)),
                       "method": "VmHWM (reset via /proc/self/clear_refs)" if self._hwm else "psutil sampling 2 ms"}


def merge_peaks(results: list[dict]) -> dict:
    """Max over several :class:`PeakMemory` results of the same device."""
    if not results:
        return {}
    out = dict(results[0])
    for r in results[1:]:
        for key, value in r.items():
            if key.endswith("_bytes"):
                out[key] = max(out[key], value)
    return out


def kv_bytes_per_token(model) -> int:
    """Bytes one token adds to an uncompressed ``DynamicCache`` of ``model`` (all layers, keys + values); for a
    llama.cpp target, to its plain f16 cache."""
    if is_llamacpp(model):
        from toolkit.kv.llamacpp_cache import LlamaCppForm, bytes_per_token

        return bytes_per_token(model.config, LlamaCppForm())
    from toolkit.engine.forward import model_kwargs

    device = next(model.parameters()).device
    cache = new_cache(None, model)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
              **model_kwargs(model, {"past_key_values": cache}))  # `cache=` where transformers takes it
    return cache.kv_bytes()
