"""Files written whole or not at all.

A reader (another process of a pod, a rerun after ``kill -9``, a user's editor) never sees a
half-written file: the content goes to a hidden temporary sibling in the same directory (so the
rename cannot cross a filesystem), and only a block that ends without an error renames it over
the target; otherwise the temporary is removed. Directories: :func:`jspec.checkpoint.orbax_io.atomic_dir`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path`` for a writer that wants a file name (a
    tokenizer's ``save``); it replaces ``path`` when the block ends without an error."""
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # pid and a random part: two processes (or threads) writing the same file never share it
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8"):
    """``open(path, mode)`` (``"w"`` or ``"wb"``) whose file appears only whole, flushed to
    disk first so a crash after the rename cannot leave it empty."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a new file: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``Path(path).write_text(text)``, whole or not at all."""
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)
