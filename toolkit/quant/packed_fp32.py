"""Dense fp32 linears on the CPU run oneDNN's GEMM on weights prepacked once, not MKL's sgemm.

PyTorch computes an fp32 ``nn.Linear`` on the CPU with MKL's ``sgemm``, which re-reads the plain row-major weight at
every call and picks its small-row code paths by CPU vendor. On the 2-core AVX2 AMD EPYC (2026-12-07, the embedded
model's 211 linears, compiled forward after a 256-token context) a 1 / 2 / 3 / 4 / 5-token forward took 49.6 / 84.2
/ 109.6 / 87.7 / 84.7 ms: a 2-token verify cost 1.7 decode steps, which prices speculation out. oneDNN (PyTorch's
``mkldnn`` backend — the kernels inductor's weight prepacking calls under ``freezing``) runs the same products on a
copy of the weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``): 47.1 / 49.3
/ 52.8 / 57.2 / 64.7 ms, a 4-token verify 1.21 steps (recipes both ways: ``bench/reports/packed-fp32-avx2/``). The
sums are the same products in another order (results differ from MKL's by fp32 rounding, as between any two GEMM
kernels).

:class:`PackedFp32Linear` keeps its ``weight`` parameter as it is (state dict, tied weights, bytes per step: all
unchanged) and holds the packed copy beside it, so fp32 weights take twice their bytes in memory
(:func:`packed_bytes`; :func:`toolkit.models.sizes.weight_bytes` counts them). Its forward calls the op through
:func:`packed_fp32_linear`, inside ``torch.compile`` an op of our own (``toolkit::packed_fp32_linear``), so the
compiled graph (no ``freezing`` needed) keeps the packed weight as an input of an opaque call; the copy is a frozen
``nn.Parameter`` held as a plain attribute, which dynamo's guard shortcut does not re-check at every call. Both
measured on the AVX2 EPYC (one process, interleaved, 30 pairs, against ``torch.library.custom_op`` on a plain tensor):
a compiled 1-token forward 39.0 -> 37.6 ms, a 4-token one 48.8 -> 46.0 ms. Inputs of other dtypes or devices, that
need gradients, or of more than :data:`PACKED_MAX_ROWS` rows (long prompts, where MKL is the faster) take
``nn.Linear``'s own forward.
:func:`use_packed_fp32` swaps the class of a loaded model's plain fp32 CPU linears (:func:`toolkit.models.load_model`
does so) where :func:`wanted` says so: by default on x86 CPUs not made by Intel (MKL's slow paths are vendor-chosen);
``TOOLKIT_FP32_KERNEL=onednn`` packs on any CPU, ``mkl`` never. The verify cost curve of such a model is cached
under its own key (:func:`toolkit.engine.cost.cost_key`); ``bench/dense_kernels.py --kernel packed-fp32`` measures
recipes both ways.
"""

from __future__ import annotations

import os

import torch

from toolkit.cpu import cpu_vendor
from toolkit.errors import ConfigError
from toolkit.quant.plain_linears import plain_cpu_linears

#: the path line's and the cost key's name of this kernel
KERNEL = "oneDNN prepacked fp32 GEMM"
#: what the cost key adds to the kernel's name: moved when a change of the op moves its costs, so verify cost
#: curves cached before it are measured again (2: the op's call overhead cut, 2026-12-07)
REVISION = 2
#: input rows up to which a forward runs the packed copy; more (long prompts) run MKL, faster there: on the AVX2 EPYC
#: the model's linears alone took 626 vs 680 ms at 256 rows (oneDNN ahead at every narrower width, 1.9x at 8 rows),
#: while a whole 1,000-token prompt forward took 2.30 s on oneDNN against MKL's 2.06-2.12
PACKED_MAX_ROWS = 256


#: the op a compiled graph calls: defined with ``torch.library``'s low-level API, whose dispatcher calls the Python
#: kernel directly (``torch.library.custom_op``'s wrapper added ~17 us a call on the AVX2 EPYC, 3.6 ms a forward of
#: the embedded model's 211 linears); its kernel is registered for every backend (CompositeExplicitAutograd), as the
#: packed argument dispatches as ``MkldnnCPU``
_LIBRARY = torch.library.Library("toolkit", "FRAGMENT")
_LIBRARY.define("packed_fp32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")
_ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _ONEDNN_LINEAR(x.contiguous(), packed, bias, "none", [], "")


_LIBRARY.impl("packed_fp32_linear", _onednn, "CompositeExplicitAutograd")


@torch.library.register_fake("toolkit::packed_fp32_linear", lib=_LIBRARY)
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.size(0)))


def packed_fp32_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` through oneDNN with ``packed`` = ``torch.ops.mkldnn._reorder_linear_weight(W)``. ``x``
    ``(..., in_features)`` fp32 on the CPU -> ``(..., out_features)``. Inside ``torch.compile`` the op
    ``toolkit::packed_fp32_linear`` (an opaque call of the graph), else oneDNN's op directly."""
    if torch.compiler.is_compiling():
        return torch.ops.toolkit.packed_fp32_linear.default(x, packed, bias)
    return _onednn(x, packed, bias)


#: ``$TOOLKIT_FP32_KERNEL``'s values: ``auto`` (oneDNN where MKL runs off its Intel code paths), ``onednn``, ``mkl``
FP32_KERNELS = ("auto", "onednn", "mkl")


def wanted() -> bool:
    """Whether :func:`use_packed_fp32` packs on this machine: this PyTorch has oneDNN enabled, and
    ``$TOOLKIT_FP32_KERNEL`` says ``onednn``, or ``auto`` (the default) on an x86 CPU not made by Intel, where MKL's
    small-row paths are the slow ones measured above (on Intel CPUs MKL's fp32 verify forwards measured flat: a
    2-core Xeon's ``short-exact`` verified 25.8 ms a round against a 24.4 ms step, so there the packed copy's bytes
    would buy nothing known). Raises :class:`~toolkit.errors.ConfigError` for another value."""
    choice = os.environ.get("TOOLKIT_FP32_KERNEL", "auto").strip().lower() or "auto"
    if choice not in FP32_KERNELS:
        raise ConfigError("TOOLKIT_FP32_KERNEL", f"unknown kernel {choice!r}", FP32_KERNELS)
    if choice == "mkl" or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return choice == "onednn" or cpu_vendor() not in ("GenuineIntel", "")


class PackedFp32Linear(torch.nn.Linear):
    """``nn.Linear`` whose fp32 CPU forwards run oneDNN's GEMM on :attr:`packed`, a copy of ``weight`` reordered
    once into oneDNN's blocked layout (see the module docstring). Input ``(..., in_features)`` ->
    ``(..., out_features)``; forwards of more than :data:`PACKED_MAX_ROWS` rows (prompts) run ``nn.Linear``'s own.
    The copy is made by :meth:`pack` and refreshed in eager calls after ``weight`` changed in place (its version
    counter moved); a compiled graph reads the copy as it is."""

    packed: torch.Tensor
    _packed_version: int

    def pack(self) -> None:
        """(Re)make :attr:`packed` from ``weight`` (fp32, CPU)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        # a frozen Parameter, set as a plain attribute (not registered: no state dict entry, not in parameters()):
        # dynamo's guard shortcut skips the metadata checks of Parameters, which for 211 packed tensors as plain
        # tensors cost 1.1 ms of a 52 ms forward's guard lookup (toolkit.engine.guards)
        object.__setattr__(self, "packed", torch.nn.Parameter(packed, requires_grad=False))
        self._packed_version = _version(self.weight)

    def __getstate__(self) -> dict:  # copies and pickles hold the weight; oneDNN's opaque copy has no storage
        state = dict(super().__getstate__())
        state.pop("packed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or weight.device.type != "cpu" or x.numel() > PACKED_MAX_ROWS * self.in_features
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return super().forward(x)
        if not torch.compiler.is_compiling() and _version(weight) != self._packed_version:
            self.pack()
        return packed_fp32_linear(x, self.packed, self.bias)


def _version(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place version counter; -1 for an inference tensor (it has none, and cannot change)."""
    return -1 if tensor.is_inference() else tensor._version


def use_packed_fp32(model: torch.nn.Module) -> int:
    """Make every plain fp32 ``nn.Linear`` of ``model`` on the CPU a :class:`PackedFp32Linear` where :func:`wanted`
    says so (quantized weights — tensor subclasses, other layer classes — are left alone). Returns how many layers
    changed. Raises :class:`~toolkit.errors.ConfigError` for a bad ``$TOOLKIT_FP32_KERNEL``."""
    if not wanted():
        return 0
    layers = plain_cpu_linears(model, torch.float32)
    for module in layers:
        module.__class__ = PackedFp32Linear
        module.pack()
    return len(layers)


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed copies :class:`PackedFp32Linear` layers of ``model`` hold beside their weights."""
    return sum(torch.ops.mkldnn._nbytes(m.packed) for m in model.modules() if isinstance(m, PackedFp32Linear))


def uses_packed_fp32(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` is a :class:`PackedFp32Linear` (what the path line and the verify cost curve's
    cache key say)."""
    return any(isinstance(m, PackedFp32Linear) for m in model.modules())
