"""The dense layers a CPU kernel choice applies to (:mod:`toolkit.quant.fp32_products`,
:mod:`toolkit.quant.packed_fp32`)."""

from __future__ import annotations

import torch


def plain_cpu_linears(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.nn.Linear]:
    """The layers of ``model`` whose class is exactly ``nn.Linear`` with a plain ``dtype`` weight on the CPU: not a
    quantized tensor subclass (torchao, bitsandbytes), not another layer class (int4 layers, an already swapped
    class), not on another device."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and type(m.weight.data) is torch.Tensor and m.weight.dtype == dtype
            and m.weight.device.type == "cpu"]
