"""An EAGLE head at a recipe's ``draft.precision``: a float dtype as loaded, or int8 weights.

``fp32`` / ``bf16`` / ``fp16`` load the head in that dtype (:func:`~toolkit.eagle.checkpoint.load_head`). ``int8``
loads it in ``draft.torchao_compute_dtype`` (``auto``: bf16) and replaces every ``nn.Linear`` weight of the head
(``fc``, the decoder layer's projections, the LM head over the draft vocabulary) by torchao's symmetric
per-output-channel int8 (``Int8WeightOnlyConfig``, through ``quantize_``): half the bytes a bf16 step reads. A shared
embedding (the target's) is not the head's to quantize and stays as the target holds it.

Why weight-only at bf16 activations, whatever ``draft.torchao_int8`` says (that field is the target's and a draft
model's): one head step of the shipped SmolLM2 head (one row, one token, compiled, 2-core AMD EPYC with avx512_bf16)
took 1.38-1.62 ms in bf16, **0.69-0.73 ms** as int8 weight-only at bf16 activations, 1.29-1.42 ms as int8 dynamic
activations (W8A8) and 5.3-5.5 ms as int8 weight-only at fp32 activations (a slow path in this torch build); fp32
3.2-3.3 ms. The head only proposes tokens, so its precision never changes what the target commits (greedy or
sampled): it moves the acceptance rate, which the run reports.
"""

from __future__ import annotations

from toolkit.dtypes import torch_dtype


def load_recipe_head(spec, target, field: str = "draft"):
    """The EAGLE head of a recipe's ``draft`` section ``spec`` (a :class:`~toolkit.models.spec.ModelSpec`: its
    ``source``, ``precision`` and, for int8, ``torchao_compute_dtype``), fitted to ``target`` on its device.

    Raises:
        ConfigError (``{field}.source``): as :func:`~toolkit.eagle.checkpoint.load_head`.
        ModelLoadError (``{field}.backend``): int8 without torchao installed.
        KeyError: a precision outside :data:`toolkit.recipe.sections.EAGLE_PRECISIONS` (a recipe's own validation
            names the field first).
    """
    from toolkit.eagle.checkpoint import load_head, resolve_head

    source = resolve_head(spec.source, f"{field}.source")
    if spec.precision != "int8":
        return load_head(source, target, f"{field}.source", dtype=torch_dtype(spec.precision))
    from toolkit.quant.torchao import import_quietly

    compute = "bf16" if spec.torchao_compute_dtype == "auto" else spec.torchao_compute_dtype
    head = load_head(source, target, f"{field}.source", dtype=torch_dtype(compute))
    quantization = import_quietly(field)
    quantization.quantize_(head, quantization.Int8WeightOnlyConfig())  # every nn.Linear (embeddings are not)
    return head
