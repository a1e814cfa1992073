"""The shims that run fla's Triton kernels on CPU under Triton's interpreter (packtrain/packed/kernels/interpreter.py):
each shim on stand-ins (the loop-variable rewrite, the index of a one-element block, the language patched once per
grid), then a small kernel with what fla's kernels need of them (autotuned configs, a loop variable used as a
tensor, a device function called in a loop) run under the interpreter against its result computed by hand, and the
refusal of fla imported before the interpreter was on. fla's own kernels: tests/packed/kernels/test_fla_interpreter.py."""

import ast
import types

import numpy as np
import pytest
import torch
from fla_interp import fla_cpu_backend, needs_interpreter

from packtrain.packed.kernels import interpreter

try:  # the kernel below is decorated at import; without triton its test is skipped (needs_interpreter)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _times(x, i):
        return x * i.to(tl.float32)

    @triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
    @triton.jit
    def _sum_of_multiples(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(n):
            acc += _times(x, i.to(tl.int64))
        tl.store(out_ptr + offsets, acc, mask=offsets < n)


def test_loop_variables_are_rebound_first_in_their_loop_body():
    """The interpreter rewrites every assignment ``x = v`` to ``x = to_tensor(v)`` (stood in for here): a loop's
    body now starts with ``i = to_tensor(i)``, so fla's ``i.to(tl.int64)`` meets a tensor; a loop over a tuple of
    names is left as it was."""
    class Rewrite(ast.NodeTransformer):
        def visit_Assign(self, node):
            node.value = ast.Call(func=ast.Name(id="to_tensor", ctx=ast.Load()), args=[node.value], keywords=[])
            return node

    source = "def f(n):\n    for i in range(n):\n        for a, b in pairs:\n            g(a, i)\n"
    tree = interpreter._loop_variables_as_tensors(Rewrite).visit(ast.parse(source))
    assert ast.unparse(tree) == ("def f(n):\n    for i in range(n):\n        i = to_tensor(i)\n"
                                 "        for a, b in pairs:\n            g(a, i)")


def test_a_one_element_block_is_an_index():
    """triton before 3.9 reads a block used as an index with ``int(data)``, which NumPy 2 refuses for a 1-D array;
    the shim's ``__index__`` squeezes it first, after the interpreter's own patches of the tensor class."""
    class Block:
        pass

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    patched = []
    interpreter._index_of_one_element(lambda tensor, scope: patched.append(tensor))(Block, Scope())
    one, scalar = Block(), Block()
    one.handle, scalar.handle = types.SimpleNamespace(data=np.array([2])), types.SimpleNamespace(data=np.array(1))
    assert patched == [Block] and [10, 20, 30][one] == 30 and [10, 20, 30][scalar] == 20


def test_the_language_is_patched_once_per_grid_and_restored_at_its_end(monkeypatch):
    """A grid's first patch is the interpreter's; a device function inside it that sees the same language modules
    patches nothing, one that sees another module adds its patch; the grid's restore undoes them all, last first,
    and the next grid patches again."""
    import triton.language as tl

    monkeypatch.setattr(interpreter._GridPatch, "active", None)
    events = []

    class Scope:
        def __init__(self, name):
            self.name = name

        def restore(self):
            events.append(("restore", self.name))

    def patch_lang(fn):
        events.append(("patch", fn.__name__))
        return Scope(fn.__name__)

    def function(name, **globals_):  # a function whose module holds ``globals_``
        return types.FunctionType((lambda: None).__code__, globals_, name)

    kernel, helper, core_helper = function("kernel", tl=tl), function("helper", tl=tl), function("core", c=tl.core)
    patch = interpreter._patch_lang_once_per_grid(patch_lang)
    grid = patch(kernel)
    patch(helper).restore()  # a device function's: the interpreter never restores it; nothing to undo
    patch(helper)
    patch(core_helper)
    assert events == [("patch", "kernel"), ("patch", "core")]
    grid.restore()
    assert events[2:] == [("restore", "core"), ("restore", "kernel")] and interpreter._GridPatch.active is None
    patch(helper)
    assert events[4:] == [("patch", "helper")]


@needs_interpreter
def test_an_autotuned_kernel_with_a_loop_variable_and_a_device_function_runs_interpreted():
    """What fla's kernels ask of the interpreter, in one small kernel: two autotune configs (timed by a driver the
    interpreter does not have, without the shim), ``i.to(tl.int64)`` on a loop variable, a device function called
    in the loop. x[j] * (0 + 1 + ... + n-1) each, and triton.language as it was after the grid."""
    fla_cpu_backend()  # applies the shims
    arange = tl.arange
    x, out = torch.tensor([1.0, 2.0, -3.0]), torch.zeros(3)
    _sum_of_multiples[(1,)](x, out, 3)
    assert out.tolist() == [3.0, 6.0, -9.0] and tl.arange is arange


@needs_interpreter
def test_fla_imported_before_the_interpreter_is_refused(monkeypatch):
    """A kernel of fla compiled for a GPU (a JITFunction, under autotune's wrapper) means fla was imported before
    TRITON_INTERPRET=1: a clear error, where interpreted kernels pass."""
    from fla.ops.common import chunk_delta_h
    from triton.runtime.jit import JITFunction

    interpreter._check_fla_interpreted()

    def compiled(x):
        return x

    monkeypatch.setattr(chunk_delta_h, "compiled_stand_in", types.SimpleNamespace(fn=JITFunction(compiled)),
                        raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 in the environment before starting the process"):
        interpreter._check_fla_interpreted()
