"""jspec.atomic: a file appears whole or not at all."""

import pytest

from jspec import atomic


def test_write_text_replaces_whole_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "sub" / "f.json"
    atomic.write_text(p, "old")
    atomic.write_text(p, "new")
    assert p.read_text() == "new"
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.json"]


def test_an_error_inside_the_block_keeps_the_old_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_open(p, "wb") as f:
            f.write(b"half")
            raise RuntimeError("writer failed")
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]


def test_atomic_path_for_writers_that_want_a_name(tmp_path):
    p = tmp_path / "t.txt"
    with atomic.atomic_path(p) as tmp:
        assert tmp.parent == tmp_path and tmp != p
        tmp.write_text("x")
        assert not p.exists()           # not visible before the block ends
    assert p.read_text() == "x"


def test_append_modes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic.atomic_open(tmp_path / "a", "a"):
            pass
