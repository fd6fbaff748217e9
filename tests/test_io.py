"""toolkit.io: atomic writes leave either the old file or the whole new one, with an ordinary file mode."""

from __future__ import annotations

import os
import stat

import pytest

from toolkit.io import _CREATE_MODE, atomic_write, atomic_write_json, atomic_write_text


def test_written_file_gets_the_mode_open_would_give(tmp_path):
    atomic_write_text(tmp_path / "report.md", "hello\n")
    plain = tmp_path / "plain.md"
    plain.write_text("hello\n")
    mode = stat.S_IMODE((tmp_path / "report.md").stat().st_mode)
    assert mode == stat.S_IMODE(plain.stat().st_mode) == _CREATE_MODE
    assert mode & stat.S_IRGRP  # readable by others under the usual umask, not mkstemp's 0600


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "result.json"
    atomic_write_json(target, {"a": 1})
    before = target.read_bytes()

    def broken(tmp):
        tmp.write_text('{"a": ')  # half-written
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, broken)
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["result.json"]
