"""``benchmarks/quant.py``'s parting report: where a speculative row leaves its plain one, and how
near a tie the two tokens were there (the pure parts; the whole command runs SmolLM2)."""

import pytest

quant = pytest.importorskip("benchmarks.quant")


def test_first_parting_finds_the_first_difference():
    assert quant.first_parting([1, 2, 3], [1, 2, 3]) is None
    assert quant.first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert quant.first_parting([1, 2], [1, 2, 3]) == 2
    assert quant.first_parting([], []) is None


def test_equal_cell_reports_the_widest_gap():
    assert quant.equal_cell([]) == "yes"
    cell = quant.equal_cell([{"row": 0, "at": 3, "gap": 0.004},
                             {"row": 2, "at": 9, "gap": 0.021}])
    assert cell == "no: 2 rows, gap <= 0.021"


def test_partings_weigh_the_two_tokens_under_the_target(stories_dir):
    import numpy as np

    import jspec
    target = jspec.load_target(stories_dir)
    prompt = [1, 403, 407]
    plain = jspec.generate(target, [prompt], max_new_tokens=6).tokens[0]
    other = plain[:3] + [(plain[3] + 1) % target.config.vocab_size] + plain[4:]
    assert quant.partings(target, [prompt], [plain], [plain]) == []
    (parted,) = quant.partings(target, [prompt], [plain], [other])
    lp = quant.next_logprobs(target, prompt + plain[:3])[-1]
    assert parted["row"] == 0 and parted["at"] == 3
    assert np.isclose(parted["gap"], abs(lp[plain[3]] - lp[other[3]]))
    assert parted["gap"] > 0          # plain's greedy token is the argmax: the other is below it
    (short,) = quant.partings(target, [prompt], [plain], [plain[:4]])
    assert short["gap"] == float("inf")
