"""SpecConfig: knobs are validated up front with messages that say what is wrong."""

import pytest
from hypothesis import given, settings, strategies as st

from jspec.spec_config import MAX_TREE_NODES, SpecConfig, SpecConfigError


@pytest.mark.parametrize("S,K,N,match", [
    (4, 1, 4, r"topk=1 is a chain.*num_steps \+ 1 = 5.*num_draft_tokens=4"),
    (4, 1, 6, r"topk=1 is a chain.*got num_draft_tokens=6"),
    (1, 1, 3, r"topk=1 is a chain"),
    (2, 2, 12, r"needs 11 drafts.*K \+ \(S-1\)\*K\*K = 6"),
    (1, 4, 6, r"needs 5 drafts.*= 4"),
    (3, 8, 65, r"num_draft_tokens=65 > 64"),
    (10, 8, 100, r"> 64"),
    (0, 4, 8, r"num_steps must be >= 1, got 0"),
    (-1, 1, 0, r"num_steps must be >= 1"),
    (3, 0, 4, r"topk must be >= 1, got 0"),
    (3, 2, 1, r"num_draft_tokens must be >= 2"),
])
def test_rejected_with_message(S, K, N, match):
    with pytest.raises(SpecConfigError, match=match):
        SpecConfig(S, K, N)


def test_error_is_value_error():
    assert issubclass(SpecConfigError, ValueError)
    with pytest.raises(ValueError):
        SpecConfig(3, 1, 5)


@pytest.mark.parametrize("S,K,N,pool", [
    (5, 4, 8, 4 + 4 * 16),
    (3, 1, 4, 3),
    (6, 8, 32, 8 + 5 * 64),
    (3, 2, 5, 2 + 2 * 4),
    (4, 3, 17, 3 + 3 * 9),
    (2, 8, 64, 8 + 64),
    (1, 4, 5, 4),          # N - 1 == pool exactly
    (2, 2, 7, 6),          # N - 1 == pool exactly
])
def test_accepted(S, K, N, pool):
    c = SpecConfig(S, K, N)
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (S, K, N)
    assert c.pool_size == pool
    assert c.accept_width == S + 1
    assert c.is_chain == (K == 1)


def test_defaults_and_chain():
    c = SpecConfig()
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (5, 4, 8)
    ch = SpecConfig.chain(5)
    assert ch == SpecConfig(5, 1, 6)
    assert ch.is_chain and ch.pool_size == 5 and ch.accept_width == 6
    assert SpecConfig.chain(1) == SpecConfig(1, 1, 2)
    assert MAX_TREE_NODES == 64
    with pytest.raises(SpecConfigError):
        SpecConfig.chain(0)
    with pytest.raises(SpecConfigError, match="> 64"):
        SpecConfig.chain(64)   # 65 nodes


def test_frozen_and_hashable():
    c = SpecConfig(5, 4, 8)
    with pytest.raises(Exception):
        c.topk = 2
    assert hash(c) == hash(SpecConfig(5, 4, 8))


@settings(deadline=None, max_examples=300)
@given(st.integers(-1, 12), st.integers(-1, 10), st.integers(-1, 80))
def test_validation_matches_rules(S, K, N):
    ok = (S >= 1 and K >= 1 and 2 <= N <= 64 and (K != 1 or N == S + 1)
          and N - 1 <= K + (S - 1) * K * K)
    if ok:
        c = SpecConfig(S, K, N)
        assert c.pool_size == K + (S - 1) * K * K >= N - 1
        assert c.accept_width == S + 1
    else:
        with pytest.raises(SpecConfigError):
            SpecConfig(S, K, N)
