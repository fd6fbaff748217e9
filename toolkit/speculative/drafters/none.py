"""``drafter: none`` — plain autoregressive decoding: no drafter, the decode loop runs one-token steps."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.speculative.drafters.registry import DrafterConfig, register_drafter


@dataclass
class NoDrafterConfig(DrafterConfig):
    """``drafter: none`` — no speculation (the reference the speedups are measured against)."""

    name = "none"
    speculates = False
    batch = True


@register_drafter(NoDrafterConfig)
class NoDrafter:
    """Builds no drafter: :class:`~toolkit.engine.decoder.SpeculativeDecoder` with ``drafter=None`` is AR."""

    @classmethod
    def from_config(cls, config: NoDrafterConfig, context) -> None:
        return None
