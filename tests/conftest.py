from pathlib import Path

import pytest

# The repo is cloned next to shared/, which holds the real-model fixtures.
SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    d = SHARED / "models" / "stories260K"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"stories260K fixture not found at {d}")
    return d
