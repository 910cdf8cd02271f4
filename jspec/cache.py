"""Where jspec keeps what it makes or fetches once per machine: ``$JSPEC_CACHE_DIR``, else
``~/.cache/jspec`` (fetched models in ``models/``, the demo's calibration, compiled programs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE_DIR", Path.home() / ".cache" / "jspec"))
