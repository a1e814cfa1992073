"""transformers' unpacked GDN kernels routed on CPU (packtrain/packed/kernels/hf_route.py): CPU tensors go to the torch
function transformers wrapped, everything else to transformers' own choice; packed sequences refused; the kernel
packages hidden while transformers binds its CPU kernels. Runs with or without fla."""

import importlib
import sys

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import packtrain.packed.patch  # noqa: F401 (installs the routing)
from packtrain.packed.kernels import hf_route, torch_ref


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


def test_routing_again_leaves_the_routers_in_place():
    """route_unpacked_kernels runs at patch.py's import and again from packtrain.use_torch_kernels_on_cpu: a second call
    must not wrap a router in another one."""
    before = {name: getattr(hf, name) for name in hf_route.KERNEL_NAMES}
    hf_route.route_unpacked_kernels()
    assert all(getattr(hf, name) is router for name, router in before.items())


def test_hidden_kernel_packages_fail_to_import_only_inside_the_block(monkeypatch):
    """A stand-in package (colorsys, not imported yet) is hidden as fla is: its import fails inside the block, and
    works again after it."""
    monkeypatch.setattr(hf_route, "KERNEL_PACKAGES", ("colorsys",))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    with hf_route.kernel_packages_hidden(), pytest.raises(ModuleNotFoundError, match="colorsys is hidden"):
        importlib.import_module("colorsys")
    assert importlib.import_module("colorsys").rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
