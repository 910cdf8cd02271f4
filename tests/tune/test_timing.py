"""The timing harness: warm-up calls untimed, then rounds that rotate the calls' order."""

from jspec.timing import round_robin


def test_rounds_rotate_so_no_call_always_follows_the_same_one():
    log = []
    calls = {k: (lambda k=k: log.append(k) or k) for k in "abc"}
    t = round_robin(calls, repeats=3, warmup=1)
    assert log == list("abc") + list("abc") + list("bca") + list("cab")
    assert all(len(x.times) == 3 and x.result == k for k, x in t.items())
    followers = {(log[i], log[i + 1]) for i in range(3, len(log) - 1)}
    assert ("a", "b") in followers and ("c", "a") in followers   # a's predecessor changes
