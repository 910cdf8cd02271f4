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


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop each module's compiled programs when it ends. One process compiles a few hundred
    programs; a full run once segfaulted inside an XLA compile late in the run (the same
    test passes alone), and holding fewer live executables is the mitigation."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
