"""The second edition's stages (GPU issue 2: acceptance, weights, long-context KV, model drafters, a head trained on
the GPU, the search), one module per stage, imported when the stage runs so that one module failing to import fails
its own stage only (``gpu_bench.run_stage`` records it and the next stage runs)."""

from __future__ import annotations

import importlib

#: stage name -> (module in gpu_kit, function taking the Kit), in the GPU issue's priority order
MODULES = {
    "accept_identity": ("accept_identity", "accept_identity"),
    "width_probe": ("width_probe", "width_probe"),
    "kivi_device": ("kivi_device", "kivi_device"),
    "weights": ("weights", "weights"),
    "kv_long": ("kv_long", "kv_long"),
    "drafters_real": ("drafters_real", "drafters_real"),
    "compositions": ("compositions", "compositions"),
    "eagle_train": ("eagle_gpu", "eagle_train"),
    "search": ("search_gpu", "search"),
}


def run(kit, name: str):
    """Import stage ``name``'s module and run its function on ``kit``."""
    module, function = MODULES[name]
    return getattr(importlib.import_module(f"gpu_kit.{module}"), function)(kit)


def stages(kit) -> dict:
    """``{name: () -> result}`` for every second-edition stage."""
    return {name: (lambda name=name: run(kit, name)) for name in MODULES}
