"""Unpacked forwards (standalone examples, eval, a plain transformers loop) on CPU take transformers' pure-torch
kernels, even where fla is importable.

Why: transformers picks the Gated DeltaNet kernels when its modeling module is imported (hub kernels, then the
``fla`` / ``causal_conv1d`` packages, then its torch fallback; ``use_kernel_func_from_hub_with_fallback``). With
fla installed on a CPU machine (the ``fla`` extra, for the interpreter tests) it calls fla's Triton kernels on CPU
tensors and fails with "0 active drivers". So each of those module-level names is replaced, once, by a router:
CPU tensors go to the torch function transformers wrapped (:func:`torch_function`), everything else to transformers'
own choice, unchanged. (transformers 5.25 sends CPU inputs to its torch functions itself; the routers change nothing
there, and keep the refusal of packed sequences, which its fallback refuses too.) Packed forwards never reach these names (:mod:`packtrain.packed.gdn` runs the pack).

On a machine without CUDA those modules are first imported with fla and causal_conv1d unimportable
(:func:`kernel_packages_hidden`), so transformers binds its torch functions from the start and the process never
imports fla (with triton, 5-8 s of every start here) unless ``model.kernels: fla`` asks for it; the routers then
change nothing. Where fla was imported before (a test, a user's script), the routers still catch its CPU calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys

import torch

# transformers modules whose GDN layers look these names up at call time (the families packtrain runs)
MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
           "transformers.models.qwen3_next.modeling_qwen3_next")
KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")


# the optional packages transformers binds GDN kernels from at import (its fallback order: hub kernels, these, torch)
KERNEL_PACKAGES = ("fla", "causal_conv1d")


class _Unimportable(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} is hidden while transformers binds its CPU kernels (packtrain)",
                                  name=spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise ModuleNotFoundError(module.__name__)


class _HideKernelPackages(importlib.abc.MetaPathFinder):
    """Finds :data:`KERNEL_PACKAGES` (a ``find_spec`` query still sees them installed) and fails their import."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in KERNEL_PACKAGES:
            return importlib.machinery.ModuleSpec(name, _Unimportable())
        return None


@contextlib.contextmanager
def kernel_packages_hidden():
    """Within the block, importing fla or causal_conv1d fails as if they were not installed (unless already
    imported: sys.modules answers first)."""
    finder = _HideKernelPackages()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x
    return None


def torch_function(chosen):
    """The pure-torch function under transformers' binding of a kernel name (None: none found): the ``__wrapped__``
    of its wrapper (5.24), or of the function inside the ``kernels`` package's ``Func`` module that 5.25 binds."""
    reference = getattr(chosen, "__wrapped__", None)
    if reference is None and isinstance(chosen, torch.nn.Module):
        inner = inspect.getclosurevars(type(chosen).forward).nonlocals.get("func")
        reference = getattr(inner, "__wrapped__", None)
    return reference


def _router(name: str, chosen):
    reference = torch_function(chosen)

    @functools.wraps(reference)
    def route(*args, **kwargs):
        x = _first_tensor(args, kwargs)
        if x is None or x.device.type != "cpu":
            return chosen(*args, **kwargs)
        # transformers' torch fallbacks cannot keep packed sequences apart; its wrapper refuses them, so must we
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name}: the torch fallback on CPU cannot take cu_seqlens / seq_idx (packed sequences)")
        return reference(*args, **kwargs)

    route.__wrapped__ = reference  # as transformers' wrapper: the torch function under it
    route.packtrain_routed = True
    return route


def route_unpacked_kernels() -> None:
    """Install the CPU routers in every module of :data:`MODULES` this transformers has (idempotent); without CUDA,
    a module not imported yet is imported with the kernel packages hidden."""
    hide = kernel_packages_hidden if not torch.cuda.is_available() else contextlib.nullcontext
    for module_name in MODULES:
        try:
            with hide():
                module = importlib.import_module(module_name)
        except ImportError:  # an older transformers without this family
            continue
        for name in KERNEL_NAMES:
            chosen = getattr(module, name, None)
            if chosen is None or getattr(chosen, "packtrain_routed", False) or torch_function(chosen) is None:
                continue
            setattr(module, name, _router(name, chosen))
