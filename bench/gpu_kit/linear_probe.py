"""The weight kernels alone: what a format's linear layers cost at one token, apart from the decoder around them.

An H100 ran torchao int4 (tinygemm, ``tile_packed_to_4d``) at 0.97x and 0.64x our bf16 AR on the 8B shape
(2026-11-27, two sessions) with the step captured as one CUDA graph (no graph breaks, no skipped graphs), so the
question left is the kernel's: :func:`linear_probe` times each distinct linear layer of a quantized model on a
one-token input and sums them per decoded token. If that sum is most of the step, the kernel is the bound; if it is
small, the rest of the step is.

Timing (:func:`toolkit.measure.timing.time_ms`, the median of ``replays``): on CUDA, ``calls`` forwards of one
module captured into one CUDA graph, each replay between two CUDA events (launch overhead out of the figure, as in
the compiled step); elsewhere (the dry run) the host clock around ``calls`` eager calls.
"""

from __future__ import annotations

import torch

from toolkit.measure.timing import time_ms
from toolkit.models.sizes import weight_bytes


def _per_call_ms(module: torch.nn.Module, x: torch.Tensor, calls: int, replays: int) -> float:
    """Median ms of one call: ``calls`` calls (captured as one CUDA graph on CUDA) timed ``replays`` times by
    :func:`toolkit.measure.timing.time_ms`."""
    with torch.inference_mode():
        for _ in range(3):
            module(x)

        def run():
            for _ in range(calls):
                module(x)

        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            run = graph.replay
        summary, _ = time_ms(run, x.device, repeats=replays, warmup=1)
    return summary.median / calls


def linear_probe(model: torch.nn.Module, calls: int = 20, replays: int = 10) -> dict:
    """``{"ms_per_token", "bytes_per_token", "bandwidth_bytes_s", "layers": {name: {...}}}``: every distinct linear
    layer of ``model`` (by its name within a decoder layer, e.g. ``mlp.down_proj``, and ``lm_head``) timed once on a
    ``(1, 1, in_features)`` input in the model's activation dtype, times how many the model has. ``bytes`` are the
    layer's weight bytes as stored (packed codes and scales for quantized formats)."""
    groups: dict[str, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = name.split(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in name else name
            groups.setdefault(key, []).append(module)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    layers, total_ms, total_bytes = {}, 0.0, 0
    for key, modules in groups.items():
        first = modules[0]
        x = torch.randn(1, 1, first.in_features, device=next(first.parameters()).device, dtype=dtype)
        ms, nbytes = _per_call_ms(first, x, calls, replays), weight_bytes(first)
        layers[key] = {"in": first.in_features, "out": first.out_features, "count": len(modules),
                       "us": ms * 1000.0, "bytes": nbytes, "bandwidth_bytes_s": nbytes / (ms / 1000.0)}
        total_ms += ms * len(modules)
        total_bytes += nbytes * len(modules)
    return {"ms_per_token": total_ms, "bytes_per_token": total_bytes,
            "bandwidth_bytes_s": total_bytes / (total_ms / 1000.0) if total_ms else None, "layers": layers}
