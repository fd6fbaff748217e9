"""The drafter protocol: ``reset`` / ``propose`` / ``commit`` (see :mod:`toolkit.speculative.drafters`)."""

from __future__ import annotations

import torch


class Drafter:
    """Base class: a drafter with no state. Subclasses implement :meth:`propose`."""

    #: model forwards run by this drafter since the last reset (0 for model-free drafters)
    forwards: int = 0

    def reset(self) -> None:
        self.forwards = 0

    def propose(self, input_ids: torch.Tensor, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, num_accepted: int) -> None:
        pass

    def close(self) -> None:
        """Release what ``reset`` set up on shared objects (e.g. hooks on the target); called once per generation."""
