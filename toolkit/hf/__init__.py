"""This toolkit's decoder inside Hugging Face ``generate``, on your own model object::

    import toolkit.hf

    out = model.generate(**inputs, max_new_tokens=64, custom_generate=toolkit.hf.speculative("lookup"))

:func:`speculative` returns a callable for ``generate``'s ``custom_generate`` argument (transformers runs its input
preparation, then the callable's decoding loop; no ``trust_remote_code``). See
:mod:`toolkit.hf.custom_generate` for what is supported and :mod:`toolkit.hf.request` for what is refused.
"""

from toolkit.hf.custom_generate import SpeculativeGenerate, speculative
from toolkit.hf.request import SUPPORTED

__all__ = ["SUPPORTED", "SpeculativeGenerate", "speculative"]
