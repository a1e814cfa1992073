"""Shared by the tests that run fla's Triton kernels on CPU under Triton's interpreter: the skip condition and
the interpreter's back end."""

from __future__ import annotations

import pytest
import torch

from packtrain.packed.kernels import fla_available
from packtrain.packed.kernels.interpreter import interpreter_on


def _skip_reason() -> str | None:
    if not fla_available():
        return "fla is not installed (pip install -e '.[dev,fla]')"
    if torch.cuda.is_available():
        return "CUDA present: fla runs compiled there (tests/test_gpu.py)"
    if not interpreter_on():
        return "TRITON_INTERPRET is not set (tests/conftest.py sets it before fla is imported)"
    return None


SKIP_REASON = _skip_reason()
needs_interpreter = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def fla_cpu_backend():
    from packtrain.packed.kernels import select_backend

    return select_backend("fla", "cpu")  # applies the interpreter shims
