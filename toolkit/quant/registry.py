"""The weight-quantization backend registry: one class per backend, registered with what the rest of the toolkit
needs to know about it.

Modelled on the drafter registry (:mod:`toolkit.speculative.drafters.registry`). A backend file defines a subclass of
:class:`WeightBackend` whose class attributes declare its recipe name (``ModelSpec.backend``), the package it needs,
the weight precisions and device types it has kernels for and what the serving engines make of it, and whose methods
are the hooks the loader calls (:func:`toolkit.models.load_model`): ``check_kernel`` before anything loads,
``load_kwargs`` for ``from_pretrained``, ``check_model`` / ``quantize`` once the model is loaded, ``kernel_path`` for
the one log line naming the kernel. The class is decorated with ``@register_backend``.

Recipe validation, ``backend: auto`` (:func:`toolkit.quant.choose_backend`), the loader and the exporters look backends
up here by name; nothing outside this module compares backend names. Adding a backend = one new file plus one import
line in :mod:`toolkit.quant` (and its place in the measured ``auto`` table, :mod:`toolkit.quant.auto`).
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

from toolkit.errors import ConfigError

#: the ``backend`` value that picks the backend measured fastest (:mod:`toolkit.quant.auto`)
AUTO = "auto"
#: what :func:`toolkit.quant.choose_backend` returns for a plain precision (fp32 / fp16 / bf16): no backend
NONE = "none"


class WeightBackend:
    """Base class of every weight-quantization backend. Subclasses set the class attributes and override the hooks.

    Class attributes:
        name: the recipe's ``backend`` value.
        package: the Python package the backend needs (``installed`` checks it without importing it).
        precisions: the weight precisions it quantizes (``int8``, ``int4``).
        devices: the device types it has kernels for (``cpu``, ``cuda``); finer limits are in :meth:`check_kernel`.
        places_weights: ``from_pretrained`` puts the weights on the device itself (a ``device_map``): the loader does
            not move the model afterwards.
        engine_in_flight: the serving engines quantize a full-precision checkpoint the way this backend does (the
            exporters write their in-flight quantization); ``False``: they need a checkpoint quantized with it.
    """

    name: ClassVar[str] = ""
    package: ClassVar[str] = ""
    precisions: ClassVar[tuple[str, ...]] = ()
    devices: ClassVar[tuple[str, ...]] = ()
    places_weights: ClassVar[bool] = False
    engine_in_flight: ClassVar[bool] = False

    def installed(self) -> bool:
        """Whether the backend can run here: its ``package`` is importable (checked without importing it)."""
        return importlib.util.find_spec(self.package) is not None

    def check_kernel(self, spec, device, field: str) -> None:
        """Raise :class:`ConfigError` (naming ``{field}.<name>``) when the backend has no kernel for ``spec`` on
        ``device``, before any weights load. The base checks the declared precisions and devices."""
        if spec.precision not in self.precisions:
            raise ConfigError(f"{field}.precision", f"backend {self.name} has no kernel for {spec.precision}",
                              self.precisions)
        if device.type not in self.devices:
            raise ConfigError(f"{field}.device", f"backend {self.name} has no kernel on {device.type}", self.devices)

    def check_spec(self, spec, field: str) -> None:
        """Raise :class:`ConfigError` (naming ``{field}.<name>``) when the rest of the section ``spec`` cannot go with
        this backend, at recipe validation (before any model loads). Nothing by default."""

    def load_kwargs(self, spec, device, field: str) -> dict:
        """``from_pretrained`` keyword arguments (the weights' dtype at least). Raises :class:`ModelLoadError` when
        the backend's package is missing."""
        raise NotImplementedError

    def check_model(self, model, spec, field: str) -> None:
        """Raise :class:`ConfigError` when the loaded ``model`` cannot be quantized as ``spec`` (``auto`` then falls
        back to the next backend of its row). Nothing by default."""

    def quantize(self, model, spec, device, field: str):
        """Quantize the loaded ``model`` (already on ``device`` unless :attr:`places_weights`) and return it; log
        :meth:`kernel_path` once per process and format."""
        return model

    def kernel_path(self, spec, device) -> str:
        """One sentence naming the kernel that runs ``spec``'s matmuls on ``device``."""
        raise NotImplementedError


_BACKENDS: dict[str, WeightBackend] = {}


def register_backend(cls: type[WeightBackend]) -> type[WeightBackend]:
    """Class decorator: ``@register_backend class TorchaoBackend(WeightBackend)``.

    Raises:
        ValueError: the class has no name, names ``auto`` / ``none``, or the name is registered to another class.
    """
    if not cls.name or cls.name in (AUTO, NONE):
        raise ValueError(f"{cls.__name__}.name must name the backend (not {AUTO!r} or {NONE!r})")
    known = _BACKENDS.get(cls.name)
    if known is not None and (type(known).__module__, type(known).__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"backend name {cls.name!r} is already registered to {type(known).__name__}")
    _BACKENDS[cls.name] = cls()
    return cls


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registration order."""
    return tuple(_BACKENDS)


def backend_choices() -> tuple[str, ...]:
    """The allowed values of a model's ``backend``: ``auto`` and every registered name."""
    return (AUTO, *_BACKENDS)


def weight_backend(name: object, field: str = "backend") -> WeightBackend:
    """The backend registered as ``name``. Raises :class:`ConfigError` naming ``field`` and the allowed names."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ConfigError(field, f"unknown value {name!r}", backend_choices())
    return _BACKENDS[name]
