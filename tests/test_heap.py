"""toolkit.heap: a build freezes the live heap out of full garbage collections (unless TOOLKIT_GC_FREEZE=0), and a
model discarded after the freeze is still freed by reference counting."""

from __future__ import annotations

import gc
import weakref

import pytest
from conftest import tiny_llama

from toolkit.heap import ENV, freeze_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_freeze_moves_live_objects_out_of_collections(monkeypatch, unfrozen):
    monkeypatch.setenv(ENV, "1")
    model = tiny_llama()
    assert freeze_heap() is True
    assert gc.get_freeze_count() > 0 and not any(o is model for o in gc.get_objects())
    ref = weakref.ref(model)
    del model  # frozen, yet freed by reference counting: no model outlives its last reference
    assert ref() is None


def test_switched_off_leaves_the_collector_alone(monkeypatch, unfrozen):
    monkeypatch.setenv(ENV, "0")
    before = gc.get_freeze_count()
    assert freeze_heap() is False and gc.get_freeze_count() == before


def test_build_freezes(monkeypatch, unfrozen):
    import toolkit
    from toolkit.recipe import ModelSpec, Recipe, SpeculationSpec

    monkeypatch.setenv(ENV, "1")
    gc.unfreeze()
    recipe = Recipe(name="heap", target=ModelSpec(source="embedded"), spec=SpeculationSpec(drafter="none",
                                                                                           adaptive="constant"))
    toolkit.build(recipe, target=tiny_llama(vocab=49152), tokenizer=None)
    assert gc.get_freeze_count() > 0
