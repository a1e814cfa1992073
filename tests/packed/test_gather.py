"""packtrain/packed/gather.py: sums over rows in the index's order, whatever the thread count. The reference is a
serial ``index_add_`` (one thread, where torch adds the terms one after another) and float64 advanced indexing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packtrain.packed.gather import gather_rows, segment_sum

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_segment_sum_is_a_serial_index_add_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 40, (3000,), generator=g)
    index[index == 7] = 8  # a row no term goes to: 0
    values = torch.randn(3000, *shape, generator=g, dtype=dtype)
    assert torch.get_num_threads() == 1  # tests/conftest.py: index_add_ adds in order
    expected = torch.zeros(41, *shape, dtype=dtype).index_add_(0, index, values)
    got = segment_sum(values, index, 41)
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert not got[7].any() and not got[40].any()


def test_gather_rows_is_indexing_and_its_gradient_the_float64_sum():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 30, (6, 50), generator=g)
    upstream = torch.randn(6, 50, 2, 4, generator=g, dtype=torch.float64)
    out = gather_rows(x, index)
    assert torch.equal(out, x.detach()[index])
    (grad,) = torch.autograd.grad(out, x, upstream)
    expected = torch.zeros_like(x)
    for i, row in enumerate(index.flatten().tolist()):  # each read of a row adds its upstream gradient
        expected[row] += upstream.reshape(-1, 2, 4)[i]
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


# run in a process started with two threads: torch's CPU kernels run serially in a process whose thread count was 1
# first (tests/conftest.py sets 1), whatever it is set to after
_TWO_THREADS = """
import torch
from packtrain.packed.gather import gather_rows
g = torch.Generator().manual_seed(2)
x = torch.randn(64, 2, 16, generator=g, requires_grad=True)
index = torch.randint(0, 64, (100, 1000), generator=g)
upstream = torch.randn(100, 1000, 2, 16, generator=g)
grads = [torch.autograd.grad(gather_rows(x, index), x, upstream)[0] for _ in range(16)]
print(torch.get_num_threads(), sum(torch.equal(grads[0], other) for other in grads[1:]))
"""


def test_the_gradient_of_rows_read_many_times_is_the_same_on_every_call_at_two_threads():
    """Float32 rows read thousands of times (as P's keys are by every run of a tree's nodes): advanced indexing's
    backward adds them in parallel at two threads (``cpu_atomic_add_float``), in an order that changes between
    calls (with gather_rows' backward made index_put_'s, none of the other 15 calls equalled the first, in each of 6
    tries); gather_rows' does not."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _TWO_THREADS], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["2", "15"], proc.stdout
