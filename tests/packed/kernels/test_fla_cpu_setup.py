"""Choosing the fla back end on CPU (only under Triton's interpreter; runs with or without fla), and fla's own
switches and globals as the back end sets them. transformers' unpacked GDN kernels routed to torch on CPU:
tests/packed/kernels/test_hf_route.py."""

import pytest
from fla_interp import needs_interpreter

from packtrain.packed import kernels
from packtrain.packed.kernels import interpreter, select_backend


def test_fla_on_cpu_needs_the_package_and_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "fla_available", lambda: False)
    with pytest.raises(ValueError, match=r"fla.*not installed.*packtrain\[fla\]"):
        select_backend("fla", "cpu")
    monkeypatch.setattr(kernels, "fla_available", lambda: True)
    monkeypatch.setattr(interpreter, "interpreter_on", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("fla", "cpu")
    assert select_backend("auto", "cpu").gdn == "torch"  # auto never picks the interpreter


def test_fla_in_float64_is_a_config_error():
    from packtrain.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:  # fla's kernels fail on float64 inputs (an interpreter error deep inside)
        config_from_dict({"model": {"kernels": "fla", "dtype": "float64"}})
    assert e.value.problems == ["model.kernels: fla runs in float32 or bfloat16, not model.dtype float64 (use torch)"]
    config_from_dict({"model": {"kernels": "fla", "dtype": "float32"}})


@needs_interpreter
def test_the_gdn_kernel_is_pinned_in_fla_and_named_in_the_header(monkeypatch):
    """fla dispatches the chunked delta rule to FlashQLA by itself where flash_qla imports (SM90, K = V = 128):
    selecting the fla back end pins fla's Triton kernel through fla's own switch unless FlashQLA is asked for, and
    FlashQLA asked for without its package is refused."""
    from fla.ops.gated_delta_rule.backends import FlashQLABackend

    monkeypatch.setenv(kernels.FLASH_QLA_ENV, "1")
    assert FlashQLABackend().is_enabled()  # fla's default where flash_qla is installed
    backend = select_backend("fla", "cpu")
    assert not FlashQLABackend().is_enabled()
    assert backend.gdn_kernel == "triton" and "gated-deltanet=fla (its Triton delta rule, FlashQLA off)" in \
        backend.describe()
    with pytest.raises(ValueError, match="model.gdn_kernel=flash_qla but the `flash_qla` package is not installed"):
        select_backend("fla", "cpu", gdn_kernel="flash_qla")
    assert select_backend("torch", "cpu").describe().startswith("gated-deltanet=torch,")


FLA_GLOBAL_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import triton.language as tl
from fla.ops.gated_delta_rule import chunk_fwd
from fla_interp import _jit_function, fla_kernel_global

kernels = [f for f in map(_jit_function, vars(chunk_fwd).values()) if f is not None]

def compile_keys():  # what Triton records when it compiles (the globals a kernel read, with their values)
    for f in kernels:
        f.cache_key

def stale():  # what Triton's run refuses: a global whose value differs from the one its kernel compiled with
    return sorted({name for f in kernels for (name, _), (val, g) in f.used_global_vals.items() if g.get(name) != val})

compile_keys()
assert any(name == "SOLVE_TRIL_DOT_PRECISION" for f in kernels for name, _ in f.used_global_vals), "nothing read it"
before = chunk_fwd.SOLVE_TRIL_DOT_PRECISION
other = "tf32" if before.value == "ieee" else "ieee"  # ieee here, without a GPU that has TF32; tf32 on one
with fla_kernel_global(chunk_fwd, "SOLVE_TRIL_DOT_PRECISION", tl.constexpr(other)):
    print("inside", stale())
    compile_keys()
print("after", stale(), chunk_fwd.SOLVE_TRIL_DOT_PRECISION.value == before.value)
"""


@pytest.mark.process
@pytest.mark.skipif(not kernels.fla_available(), reason="fla is not installed")
def test_a_kernel_global_set_for_the_gpu_tests_leaves_no_kernel_refused_before_or_after(tmp_path):
    """tests/packed/kernels/test_gpu.py sets fla's triangular-solve precision for its float32 checks. Set by hand,
    every kernel compiled before (or, put back, during) the change would be refused by Triton for the rest of the
    process; fla_kernel_global makes them compile again. Checked without a GPU on Triton's own records (compiled
    kernels, not the interpreter's, so in a process without TRITON_INTERPRET)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", FLA_GLOBAL_CHECK, str(tests)], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.split("\n")[:2] == ["inside []", "after [] True"], out
