"""Held-out text for perplexity: real local files through `datasets`, deterministic disjoint splits."""

from __future__ import annotations

import pytest

from eval import data


def test_splits_deterministic_and_disjoint():
    for source in ("prose", "code"):
        files = data.local_files(source)
        assert files, source
        names = [f.name for f in files]
        splits = [data.split_of(n, source) for n in names]
        assert splits == [data.split_of(n, source) for n in names]  # stable
        assert "test" in splits


def test_prose_test_split_is_real_text_and_not_in_train():
    test = data.load_text("prose", "test")
    assert "GNU GENERAL PUBLIC LICENSE" in test
    train = data.load_text("prose", "train", max_chars=10**7)
    assert test[:2000] not in train


def test_code_test_split():
    text = data.load_text("code", "test", max_chars=5000)
    assert "def " in text and len(text) == 5000


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="source"):
        data.load_text("nope")
    with pytest.raises(ValueError, match="split"):
        data.load_text("prose", "dev")
    with pytest.raises(ValueError, match="split"):
        data.load_text("wikitext", "train")
