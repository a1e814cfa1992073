"""train.objective (packtrain.run.objective): the pair losses from the formula, what the step's mean is over, and a
unit's terms."""

import math
from types import SimpleNamespace

import pytest
import torch

from packtrain.run.objective import Objective, Terms


def _ex(id_, pair="", side="", weight=1.0):
    return SimpleNamespace(id=id_, pair=pair, side=side, weight=weight)


def test_the_pair_losses_are_the_formulas():
    # two pairs laid out (rejected, chosen, chosen, rejected): the terms find each side
    examples = [_ex("a:r", "a", "rejected"), _ex("a:c", "a", "chosen", 2.0), _ex("b:c", "b", "chosen"),
                _ex("b:r", "b", "rejected")]
    policy = torch.tensor([-3.0, -1.5, -7.25, -2.0], dtype=torch.float64)
    reference = torch.tensor([-2.5, -2.0, -6.0, -4.5], dtype=torch.float64)
    counts = torch.tensor([3, 2, 5, 4])
    terms = Objective("dpo").terms(examples)
    assert terms.pairs == ((1, 0), (2, 3)) and terms.weights == (2.0, 1.0)
    for beta in (0.1, 0.5):
        got = Objective("dpo", beta).pair_losses(policy, reference, counts, terms).tolist()
        want = []
        for (c, r), w in zip(terms.pairs, (2.0, 1.0)):
            margin = (policy[c] - reference[c]) - (policy[r] - reference[r])
            want.append(w * math.log1p(math.exp(-beta * float(margin))))  # -log sigmoid(x) = log(1 + e^-x)
        assert got == pytest.approx(want, rel=1e-14)
        ipo = Objective("dpo", beta, "ipo").pair_losses(policy, reference, counts, terms).tolist()
        want = []
        for (c, r), w in zip(terms.pairs, (2.0, 1.0)):
            margin = (policy[c] - reference[c]) / counts[c] - (policy[r] - reference[r]) / counts[r]
            want.append(w * (float(margin) - 1 / (2 * beta)) ** 2)
        assert ipo == pytest.approx(want, rel=1e-14)


def test_the_step_mean_is_over_pairs_under_dpo_and_examples_else():
    assert Objective("dpo").items(10) == 5
    assert Objective("sft").items(10) == Objective("weighted").items(10) == 10


def test_a_unit_with_half_a_pair_is_refused_and_a_table_gives_its_reference():
    with pytest.raises(RuntimeError, match="one answer of a preference pair"):
        Objective("dpo").terms([_ex("a:c", "a", "chosen"), _ex("b:r", "b", "rejected")])
    pair = [_ex("a:c", "a", "chosen"), _ex("a:r", "a", "rejected")]
    table = {"a:c": -1.25, "a:r": -3.5}
    assert Objective("dpo").with_table(table).terms(pair).reference == (-1.25, -3.5)
    with pytest.raises(RuntimeError, match="no entry for example 'a:r'"):
        Objective("dpo").with_table({"a:c": -1.0}).terms(pair)
    assert Objective("weighted").terms([_ex("x", weight=-0.5), _ex("y")]) == Terms((-0.5, 1.0))
    with pytest.raises(RuntimeError, match="both its answers in one graph"):
        Objective("dpo").terms(pair).subset([0])
