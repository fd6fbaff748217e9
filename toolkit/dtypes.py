"""The one table from the precision names of recipes (``fp32``, ``fp16``, ``bf16``) to torch dtypes."""

from __future__ import annotations

import torch

#: float precision name -> torch dtype (int8 / int4 are weight formats of a quantization backend, not dtypes)
FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a float precision name. Raises ``KeyError`` naming the allowed names."""
    try:
        return FLOAT_DTYPES[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a float precision (allowed: {', '.join(FLOAT_DTYPES)})") from None


def precision_name(dtype: torch.dtype) -> str:
    """The float precision name of a torch dtype (the inverse of :func:`torch_dtype`). Raises ``KeyError``."""
    for name, value in FLOAT_DTYPES.items():
        if value == dtype:
            return name
    raise KeyError(f"{dtype} is not a float precision (allowed: {', '.join(map(str, FLOAT_DTYPES.values()))})")


def mask_dtype(model) -> torch.dtype:
    """The dtype of ``model``'s additive attention masks: its first parameter's, or float32 when that parameter is
    stored as integers (quantized weights)."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype.is_floating_point else torch.float32
