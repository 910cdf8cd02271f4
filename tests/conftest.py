import os
import tempfile
from pathlib import Path

import pytest

SLOW_LIST = Path(__file__).parent / "slow_tests.txt"


def slow_node_ids() -> set[str]:
    """The node ids ``tests/slow_tests.txt`` moves out of the default run."""
    return {line.strip() for line in SLOW_LIST.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests ``slow_tests.txt`` names as slow, before ``-m`` selects by marks."""
    slow = slow_node_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)

# The repo is cloned next to shared/, which holds the real-model fixtures.
SHARED = Path(__file__).resolve().parents[2] / "shared"


def pytest_configure(config):
    """Most of the suite's time is XLA compilation, and many modules compile the same programs
    (the same tiny target and drafters at the same shapes). A persistent compilation cache for
    this run only (a fresh directory, so nothing leaks between runs and CI measures a cold
    start) lets a program compiled once serve every later module, every xdist worker and every
    subprocess (the CLI and notebook tests inherit the environment). Set JSPEC_TEST_JAX_CACHE
    to reuse a directory across runs."""
    # XLA:CPU spends most of a test's compile in LLVM; the test models are tiny, so its
    # optimisations buy nothing at run time. The HLO (fusion, layout, what the anatomy counts)
    # is the same; only machine-code optimisation is skipped. JSPEC_TEST_FULL_OPT=1 turns this
    # off. Subprocesses inherit it; tests that set XLA_FLAGS themselves append to it.
    # XLA:CPU's fusion emitters take about 40% of a speculative program's compile (6.1 s -> 3.6 s
    # for a stories260K EAGLE-3 generate, measured); the legacy emitters fuse a little
    # differently, which only the anatomy budgets see, and that test compiles with the
    # default options (benchmarks.anatomy.DEFAULT_CPU_OPTIONS).
    if not os.environ.get("JSPEC_TEST_FULL_OPT"):
        fast = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fast}".strip()
    # Scan the target's layer stack, as TPU/GPU do: a stories260K EAGLE-3 generate compiles in
    # 5.8 s instead of 7.2 s. CPU's default (unrolled) stays covered by the tests that set
    # JSPEC_STACKED_LAYERS=0 and by test_llama_parity's scan-vs-per-layer check.
    os.environ.setdefault("JSPEC_STACKED_LAYERS", "1")
    # With libtpu installed (the tpu extra) every worker loads it; let them share it, so the
    # deviceless TPU compile of test_platform works beside other workers.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cache = os.environ.get("JSPEC_TEST_JAX_CACHE")
    if not cache:
        # xdist workers inherit the controller's environment, so they share its directory.
        cache = os.environ.setdefault("JSPEC_TEST_JAX_CACHE_RUN",
                                      tempfile.mkdtemp(prefix="jspec-jax-cache-"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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

    from jspec import executables
    jax.clear_caches()
    executables.clear()
    gc.collect()


@pytest.fixture(scope="session")
def rank_model():
    """``rank_model(vocab)``: a calibration model that trusts rank 0 far more than EAGLE-2's q
    does and decays with depth and rank (rising in q): calibrated selection then drafts other
    trees."""
    import numpy as np

    from jspec.tree.calibration import FEATURES, PAIR_BUCKETS

    def make(vocab: int):
        D, R = 8, 8
        by_rank = np.where(np.arange(R) == 0, 0.9, 0.1 / (1 + np.arange(R)))
        rate = 0.9 ** np.arange(D)[:, None] * by_rank
        w = np.zeros((D, R, len(FEATURES)), np.float32)
        w[..., 0] = np.log(rate / (1 - rate))
        w[..., 1] = 0.5                                           # on log q
        return {"weights": w, "token_bias": np.zeros(2 * vocab, np.float32),
                "pair_bias": np.zeros(PAIR_BUCKETS, np.float32)}
    return make
