"""Draft-length controllers: how many tokens the drafter proposes in the next round.

* :class:`ConstantK` — always K.
* :class:`EmaK` — an acceptance-EMA controller: after each round the EMA of the round's acceptance ratio is updated;
  K shrinks by one when the EMA < 0.5 and grows by one when > 0.85, within ``[k_min, k_max]``. The thresholds follow
  the heuristic of HF's ``num_assistant_tokens_schedule="heuristic"`` made smooth by the EMA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConstantK:
    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class EmaK:
    k: int
    k_min: int = 1
    k_max: int = 8
    decay: float = 0.7
    shrink_below: float = 0.5
    grow_above: float = 0.85
    ema: float | None = None

    def __post_init__(self) -> None:
        self.k = min(max(self.k, self.k_min), self.k_max)

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        ratio = accepted / drafted
        self.ema = ratio if self.ema is None else self.decay * self.ema + (1 - self.decay) * ratio
        if self.ema < self.shrink_below:
            self.k = max(self.k_min, self.k - 1)
        elif self.ema > self.grow_above:
            self.k = min(self.k_max, self.k + 1)


def make_controller(spec) -> ConstantK | EmaK:
    """Controller for a :class:`toolkit.recipe.SpecSpec`."""
    if spec.adaptive == "ema":
        return EmaK(spec.num_draft_tokens, spec.k_min, spec.k_max, spec.ema_decay)
    return ConstantK(spec.num_draft_tokens)
