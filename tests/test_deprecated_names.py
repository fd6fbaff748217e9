"""The old public names still resolve, to the same classes, with a ``DeprecationWarning``: ``Generator`` (now
``SpeculativeLM``, module ``toolkit.speculative_lm``) and ``SpecSpec`` (now ``SpeculationSpec``)."""

from __future__ import annotations

import importlib

import pytest

from toolkit.recipe import SpeculationSpec
from toolkit.speculative_lm import SpeculativeLM


@pytest.mark.parametrize("module,old,new", [
    ("toolkit", "Generator", SpeculativeLM),
    ("toolkit.generator", "Generator", SpeculativeLM),
    ("toolkit", "SpecSpec", SpeculationSpec),
    ("toolkit.recipe", "SpecSpec", SpeculationSpec),
])
def test_deprecated_alias_warns_and_is_the_same_class(module, old, new):
    with pytest.deprecated_call(match=old):
        assert getattr(importlib.import_module(module), old) is new
