"""Choosing the fla back end on CPU (only under Triton's interpreter), and transformers' unpacked GDN kernels routed
to its torch fallbacks on CPU (where fla, if installed, cannot run compiled). Runs with or without fla."""

import pytest
import torch
from fla_interp import needs_interpreter
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import packtrain.packed.patch  # noqa: F401 (installs the routing)
from packtrain.packed import kernels
from packtrain.packed.kernels import hf_route, interpreter, select_backend, torch_ref


def test_fla_on_cpu_needs_the_package_and_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "fla_available", lambda: False)
    with pytest.raises(ValueError, match=r"fla.*not installed.*packtrain\[fla\]"):
        select_backend("fla", "cpu")
    monkeypatch.setattr(kernels, "fla_available", lambda: True)
    monkeypatch.setattr(interpreter, "interpreter_on", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("fla", "cpu")
    assert select_backend("auto", "cpu").gdn == "torch"  # auto never picks the interpreter


def test_router_sends_cpu_tensors_to_the_torch_function_and_others_to_transformers_choice():
    def reference(x, scale=1.0, **kwargs):
        return x * scale

    def chosen(*args, **kwargs):  # stands for fla's kernel, which cannot run on CPU tensors
        raise RuntimeError("0 active drivers")

    chosen.__wrapped__ = reference
    route = hf_route._router("kernel", chosen)
    x = torch.ones(3)
    assert torch.equal(route(x, scale=2.0), 2 * x)
    with pytest.raises(RuntimeError, match="0 active drivers"):
        route(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="cu_seqlens"):  # the fallback would silently mix packed sequences
        route(x, cu_seqlens=torch.tensor([0, 1, 3]))
    assert route.__wrapped__ is reference


def test_transformers_unpacked_gdn_kernels_are_routed():
    for name in hf_route.KERNEL_NAMES:
        assert getattr(hf, name).packtrain_routed, name
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g)
    v, beta = torch.randn(1, 5, 4, 8, generator=g), torch.rand(1, 5, 4, generator=g)
    gate = -torch.rand(1, 5, 4, generator=g)
    out, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    ref, _ = torch_ref.recurrent_gated_delta_rule(q, k, v, gate, beta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_fla_in_float64_is_a_config_error():
    from packtrain.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:  # fla's kernels fail on float64 inputs (an interpreter error deep inside)
        config_from_dict({"model": {"kernels": "fla", "dtype": "float64"}})
    assert e.value.problems == ["model.kernels: fla runs in float32 or bfloat16, not model.dtype float64 (use torch)"]
    config_from_dict({"model": {"kernels": "fla", "dtype": "float32"}})


@pytest.mark.process
def test_a_cpu_run_never_imports_fla(tmp_path):
    """Without CUDA, transformers' Qwen3.5 modules are imported with fla hidden (hf_route.kernel_packages_hidden),
    and check-nodes describes fla from its install: a training process never imports fla and its triton (5-8 s of
    every start on this machine) unless model.kernels: fla asks for them. The rank is forked from a server that
    imported packtrain as a CLI process does."""
    import importlib.util

    from cli_helpers import run_ranks, write_config

    cfg = write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})
    script = ("import sys\nfrom packtrain.cli import main\nfrom packtrain.ops.nodes import node_report\n"
              "assert main(sys.argv[1:]) == 0\nfields = node_report(0).fields\n"
              "print('fla imported:', 'fla' in sys.modules, '| reported:', fields['fla'], fields['fla path'])\n")
    out = run_ranks(1, "train", str(cfg), script=script).stdout
    assert "fla imported: False |" in out, out[-2000:]
    spec = importlib.util.find_spec("fla")
    if spec is not None:  # installed: named by the version and folder an import would load
        from importlib.metadata import version

        assert f"reported: {version('flash-linear-attention')} {spec.submodule_search_locations[0]}" in out, out


def test_a_router_over_transformers_fla_binding_runs_the_torch_function():
    """Where fla was imported before transformers' modules (a user's script), transformers binds fla's kernel, which
    fails on CPU tensors uncompiled; the router must send CPU calls to the torch function under it. The binding is
    made here as transformers makes it at import."""
    import inspect

    pytest.importorskip("fla")
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    torch_function = hf.torch_chunk_gated_delta_rule.__wrapped__
    bound = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(torch_function)
    # transformers 5.25 puts its wrapper inside the `kernels` package's Func module
    wrapper = inspect.getclosurevars(type(bound).forward).nonlocals["func"] if isinstance(bound, torch.nn.Module) \
        else bound
    assert inspect.getclosurevars(wrapper).nonlocals["implementation"].__module__.startswith("fla.")
    assert hf_route.torch_function(bound) is torch_function
    route = hf_route._router("torch_chunk_gated_delta_rule", bound)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g)
    v, beta = torch.randn(1, 5, 4, 8, generator=g), torch.rand(1, 5, 4, generator=g)
    gate = -torch.rand(1, 5, 4, generator=g)
    out, _ = route(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    ref, _ = torch_ref.recurrent_gated_delta_rule(q, k, v, gate, beta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


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
