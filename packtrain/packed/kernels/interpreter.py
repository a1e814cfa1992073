"""fla's Triton kernels on CPU under Triton's interpreter (``TRITON_INTERPRET=1``): for the CPU tests of the fla
back end, never for speed. Applied only in interpreter mode; nothing here runs on CUDA.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when fla is imported (transformers imports it
with its Qwen3.5 module), so it must be in the environment before the process starts.

Shims for fla 0.6.0 on triton 3.6 to 3.9 (packtrain.versions' range; check again before raising a pin):
- triton's autotuner benchmarks every config through the active driver, and the interpreter has none ("0 active
  drivers"): under the interpreter ``Autotuner.do_bench`` returns one constant time, so each kernel keeps its first
  config and no config is run just to be timed;
- the interpreter hands ``range`` loop variables to kernels as Python ints, and fla calls tensor methods on them
  (``i_t.to(tl.int64)``, fla/ops/common/chunk_delta_h.py:176): every ``for`` body now starts with ``i = i``, which
  the interpreter's own rewrite of assignments turns into ``i = to_tensor(i)``;
- and on triton before 3.9 (3.6 is what torch 2.11 pins): a one-element block used as an index is squeezed first,
  as 3.9 does, since NumPy 2 refuses ``int()`` of a 1-D array.

And one for speed: the interpreter re-patches ``triton.language`` on every call of a device function
(``_patch_lang``, which walks every member of the language modules) although the running grid has patched them
already; fla's kernels call small helpers thousands of times per launch. Inside a grid a device function's call now
patches only language modules the grid has not (none, for fla), and the grid's own restore undoes everything at its
end as before. The results are bit-identical; the gain: docs/performance.md, "fla under Triton's interpreter".
"""

from __future__ import annotations

import ast

_applied = False


def interpreter_on() -> bool:
    """Triton's own reading of TRITON_INTERPRET (False where triton is not installed)."""
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def _constant_bench(kernel_call, quantiles=None, **kwargs):
    return [1.0] * len(quantiles) if quantiles else 1.0


def _loop_variables_as_tensors(base):
    class Transformer(base):
        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                    value=ast.Name(id=node.target.id, ctx=ast.Load()))
                node.body.insert(0, ast.copy_location(self.visit_Assign(rebind), node))
            return node

    return Transformer()


class _GridPatch:
    """The language patches of one running grid (its own scope, then any a device function added)."""

    active: _GridPatch | None = None

    def __init__(self, patch_lang, fn):
        self.patch_lang = patch_lang
        self.langs: set[int] = set()
        self.scopes = []
        self.add(fn)

    @staticmethod
    def _langs(fn) -> set[int]:
        import inspect

        import triton.language as tl

        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def add(self, fn) -> None:
        langs = self._langs(fn)
        if not self.scopes or not langs <= self.langs:
            self.scopes.append(self.patch_lang(fn))
            self.langs |= langs

    def restore(self) -> None:
        _GridPatch.active = None
        while self.scopes:
            self.scopes.pop().restore()


class _NoRestore:
    def restore(self) -> None:
        pass


def _patch_lang_once_per_grid(patch_lang):
    def patch(fn):
        if _GridPatch.active is None:  # a grid starts: GridExecutor restores what this returns when it ends
            _GridPatch.active = _GridPatch(patch_lang, fn)
            return _GridPatch.active
        _GridPatch.active.add(fn)  # a device function called inside the grid
        return _NoRestore()

    return patch


def _index_of_one_element(patch_lang_tensor):
    """triton before 3.9 converts a one-element block to an index with ``int(data)``, which NumPy 2 refuses for a
    1-D array ("only 0-dimensional arrays can be converted"); 3.9 squeezes it first, as this does."""
    def patch(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch


def _check_fla_interpreted() -> None:
    """fla imported before TRITON_INTERPRET was set holds compiled kernels that cannot run on CPU."""
    from fla.ops.common import chunk_delta_h
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def kernel(obj):
        while hasattr(obj, "fn") and not isinstance(obj, (InterpretedFunction, JITFunction)):
            obj = obj.fn  # autotuner / heuristics wrappers
        return obj

    if any(isinstance(kernel(obj), JITFunction) for obj in vars(chunk_delta_h).values()):
        raise ValueError("fla was imported before TRITON_INTERPRET=1 was set, so its kernels are compiled for a GPU: "
                         "set TRITON_INTERPRET=1 in the environment before starting the process")


def apply() -> None:
    """Install the shims (idempotent). Call only with the interpreter on, before the first fla kernel runs."""
    global _applied
    if _applied:
        return
    assert interpreter_on(), "the interpreter shims are for TRITON_INTERPRET=1 only"
    from triton.runtime import autotuner, interpreter

    autotuner.Autotuner.do_bench = property(lambda self: _constant_bench)
    rewriter = interpreter.FunctionRewriter
    rewriter.ast_transformer = _loop_variables_as_tensors(type(rewriter.ast_transformer))
    interpreter._patch_lang = _patch_lang_once_per_grid(interpreter._patch_lang)
    interpreter._patch_lang_tensor = _index_of_one_element(interpreter._patch_lang_tensor)
    interpreter.InterpretedFunction.rewritten_fn.clear()  # anything rewritten before the shim is rewritten again
    _check_fla_interpreted()
    _applied = True
