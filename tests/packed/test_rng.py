"""Replaying a forward's random numbers (packtrain/packed/rng.py): inside ``replay`` the generator draws what it drew
after the state was taken; after it, the generator goes on as if the replay had not happened."""

import torch

from packtrain.packed.rng import replay, rng_state

CPU = torch.device("cpu")


def test_replay_draws_the_saved_numbers_and_leaves_the_generator_as_it_was():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        state = rng_state(CPU)
        first, second = torch.rand(6), torch.rand(6)
        with replay(state, CPU):
            again = torch.rand(6)
            mask = torch.nn.functional.dropout(torch.ones(8), 0.5)
        after = torch.rand(6)

        torch.manual_seed(5)  # the same sequence from the start, nothing replayed
        expected = [torch.rand(6) for _ in range(3)]
        torch.manual_seed(5)
        torch.rand(6)
        expected_mask = torch.nn.functional.dropout(torch.ones(8), 0.5)
    assert state[1] is None  # no CUDA state on a CPU device
    assert torch.equal(again, first) and not torch.equal(first, second)
    assert torch.equal(after, expected[2]) and torch.equal(second, expected[1])
    assert torch.equal(mask, expected_mask)
