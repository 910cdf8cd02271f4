"""A check shared by the logprob tests: returned logprobs are the teacher-forced target's."""

import numpy as np

from jspec.scoring import teacher_forced

K = 5


def assert_target_logprobs(target, prompts, tokens, logprobs, k=K, greedy=True):
    """``logprobs`` (per row, per generated token) are the teacher-forced target's."""
    assert logprobs is not None and len(logprobs) == len(tokens)
    for prompt, toks, got in zip(prompts, tokens, logprobs):
        assert len(got) == len(toks) > 0
        ref = teacher_forced(target, prompt + toks, k)[len(prompt):]
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.token == b.token == toks[i]
            assert abs(a.logprob - b.logprob) <= 1e-4, (i, a, b)
            assert len(a.top) == k
            # Ties within 1e-4 may swap places between two forwards; compare as sets then.
            ids_a, vals_a = zip(*a.top) if k else ((), ())
            ids_b, vals_b = zip(*b.top) if k else ((), ())
            np.testing.assert_allclose(vals_a, vals_b, atol=1e-4)
            if not k or min(np.abs(np.diff(vals_b)), default=1.0) > 1e-4:
                assert ids_a == ids_b, (i, a, b)
            if k and greedy:
                # The argmax's logprob and the best top-k value come from one array.
                assert a.token == a.top[0][0] and a.logprob == a.top[0][1], (i, a)
                assert a.logprob == max(vals_a)
