"""The timing harness: warm-up calls untimed, then rounds that rotate the calls' order."""

import pytest

from jspec.timing import interleaved, round_robin


def test_rounds_rotate_so_no_call_always_follows_the_same_one():
    log = []
    calls = {k: (lambda k=k: log.append(k) or k) for k in "abc"}
    t = round_robin(calls, repeats=3, warmup=1)
    assert log == list("abc") + list("abc") + list("bca") + list("cab")
    assert all(len(x.times) == 3 and x.result == k for k, x in t.items())
    followers = {(log[i], log[i + 1]) for i in range(3, len(log) - 1)}
    assert ("a", "b") in followers and ("c", "a") in followers   # a's predecessor changes


def test_parts_of_calls_interleave_and_their_times_add_up():
    log = []
    calls = {k: [(lambda k=k, j=j: log.append(f"{k}{j}") or j) for j in range(2)] for k in "ab"}
    t = interleaved(calls, repeats=2, warmup=1)
    # warm-up: each call's parts in turn; then part j of both calls before part j + 1,
    # the order rotating at every part
    assert log == ["a0", "a1", "b0", "b1", "a0", "b0", "b1", "a1", "a0", "b0", "b1", "a1"]
    assert all(x.result == [0, 1] and len(x.times) == 2 and min(x.times) > 0
               for x in t.values())
    with pytest.raises(ValueError, match="same number"):
        interleaved({"a": [lambda: 1], "b": []}, repeats=1)
