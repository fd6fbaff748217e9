"""What the decode loop reads of a generation request: a protocol, so the core does not depend on recipes.

:class:`toolkit.recipe.GenerationSpec` satisfies it (HF ``generate`` argument names); so does any object with
these attributes.
"""

from __future__ import annotations

from typing import Protocol


class DecodeParams(Protocol):
    """Generation arguments the decoder uses.

    Attributes:
        max_new_tokens: exact upper bound on generated tokens.
        do_sample: False = greedy (token-identical to AR); True = lossless speculative sampling.
        temperature / top_k / top_p: applied identically to target and draft distributions (``top_k`` 0 = off).
        ignore_eos: keep generating through EOS.
        seed: seed of the sampling ``torch.Generator``.
    """

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    ignore_eos: bool
    seed: int
