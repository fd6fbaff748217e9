"""``backend: llama.cpp``: a GGUF target's own blocks on llama.cpp's CPU kernels (ggml: AVX2 / AVX-512 int4 x int8
dot products), the target forward of :mod:`toolkit.engine.llamacpp_forward` instead of a torch model.

It is registered as a weight backend because that is what the recipe field says (who runs the weights), but unlike
the others it quantizes nothing and loads no torch weights: the loader hands the spec to
:func:`toolkit.models.llamacpp.load_llamacpp` before any other hook would run. What it accepts is checked when the
recipe is validated (:meth:`LlamaCppBackend.check_spec`): the target section only (drafts run on torch beside it),
a GGUF source (``embedded`` or a ``.gguf`` file), ``precision: native`` (the file as it is) and the CPU.
"""

from __future__ import annotations

from toolkit.errors import ConfigError
from toolkit.models.llamacpp import LLAMACPP, PACKAGE
from toolkit.quant.registry import WeightBackend, register_backend

#: what the target section's other fields must be on llama.cpp
PRECISION = "native"
DEVICES = ("auto", "cpu")
#: the weight backends a non-GGUF source or a CUDA device can use instead
TORCH_BACKENDS = ("auto", "bitsandbytes", "torchao")


def check_llamacpp_spec(spec, field: str) -> None:
    """Raise :class:`ConfigError` naming ``{field}.backend`` (or ``.precision``) unless ``spec`` can run on
    llama.cpp: the target section, a GGUF source, precision native, the CPU."""
    from toolkit.models.spec import is_gguf_source

    where = f"{field}.backend"
    if field != "target":
        raise ConfigError(where, f"llama.cpp runs the target only; the {field} runs on torch beside it",
                          TORCH_BACKENDS)
    if not is_gguf_source(spec.source):
        raise ConfigError(where, f"llama.cpp runs GGUF files, and source {spec.source!r} is not one (embedded or a "
                          ".gguf path)", TORCH_BACKENDS)
    if spec.device not in DEVICES:
        raise ConfigError(where, f"llama.cpp is built for the CPU here; device {spec.device} needs a torch backend",
                          TORCH_BACKENDS)
    if spec.precision != PRECISION:
        raise ConfigError(f"{field}.precision", f"backend llama.cpp runs the GGUF file's own blocks as they are: "
                          f"precision {PRECISION}, not {spec.precision}", [PRECISION])


@register_backend
class LlamaCppBackend(WeightBackend):
    """llama.cpp (see the module docstring); never chosen by ``backend: auto``."""

    name = LLAMACPP
    package = PACKAGE
    precisions = (PRECISION,)
    devices = ("cpu",)

    def installed(self) -> bool:
        from toolkit.models.llamacpp import installed

        return installed()  # importable, and not a build that crashes (toolkit.models.llamacpp.unusable)

    def check_spec(self, spec, field: str) -> None:
        check_llamacpp_spec(spec, field)

    def kernel_path(self, spec, device) -> str:
        return "llama.cpp's ggml CPU kernels on the GGUF file's own blocks (toolkit.engine.llamacpp_forward)"
