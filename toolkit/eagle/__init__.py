"""EAGLE feature-level draft heads (Li et al. 2024 EAGLE / EAGLE-2; Li et al. 2025 EAGLE-3).

* :mod:`toolkit.eagle.head` — the head: one decoder layer over (feature, next-token embedding) -> next feature,
  read through the target's LM head or a reduced draft vocabulary; its own KV cache with exact ``crop``.
* :mod:`toolkit.eagle.features` — :class:`FeatureHook`, the scoped forward hook that captures target features.
* :mod:`toolkit.eagle.vocab` — the reduced draft vocabulary (``d2t`` / ``t2d``).
* :mod:`toolkit.eagle.checkpoint` — save / load in the published EAGLE-1 and EAGLE-3 layouts; :func:`resolve_head`
  maps ``draft.source: embedded`` to the head shipped for the embedded target; :mod:`toolkit.eagle.speculators` —
  the speculators (vLLM) layout; :mod:`toolkit.eagle.files` — the directory both write (config + safetensors).

The drafter is :class:`toolkit.speculative.drafters.eagle.EagleDrafter`; training is ``toolkit draft eagle``
(:mod:`toolkit.distill.eagle_train`).
"""

from toolkit.eagle.checkpoint import load_head, resolve_head, save_head
from toolkit.eagle.features import FeatureHook
from toolkit.eagle.head import EagleHead, HeadCache, HeadConfig

__all__ = ["EagleHead", "HeadCache", "HeadConfig", "FeatureHook", "load_head", "save_head", "resolve_head"]
