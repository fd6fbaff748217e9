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


def test_errors_name_the_file_asked_for_not_the_temporary(tmp_path, monkeypatch):
    """A write that fails (the temporary file cannot be created, as in /proc; the writer fails on a full disk) raises
    an OSError of the same kind about the path the caller gave, which is what the CLI's one-line error prints, and
    leaves nothing behind."""
    import toolkit.io

    target = tmp_path / "result.json"

    def full_disk(tmp):
        raise OSError(28, "No space left on device", str(tmp))

    with pytest.raises(OSError) as raised:
        atomic_write(target, full_disk)
    assert (raised.value.errno, raised.value.filename) == (28, str(target))
    assert os.listdir(tmp_path) == []

    def no_temporary(dir, prefix, suffix):
        raise FileNotFoundError(2, "No such file or directory", os.path.join(dir, prefix + "x1y2" + suffix))

    monkeypatch.setattr(toolkit.io.tempfile, "mkstemp", no_temporary)
    with pytest.raises(FileNotFoundError) as raised:
        atomic_write_text(target, "{}")
    assert raised.value.filename == str(target)
