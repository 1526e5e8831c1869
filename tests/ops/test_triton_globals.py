"""Every module global a Triton kernel reads is something a compiled kernel may read.

Compiled (on a GPU), Triton refuses a plain module global inside an ``@triton.jit`` function ("Cannot access global
variable ... Triton kernels can only access global variables that are instantiated as constexpr"); the interpreter
does not check. The 2026-12-04 H200 run failed every entmax kernel on ``HIST_FIELDS = 16``: this test catches that
class of error on a machine without a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

KERNEL_MODULES = [
    "block_sparse.triton_fwd",
    "block_sparse.triton_bwd",
    "bfla_plan.triton_estimate",
    "bfla_plan.triton_plan",
    "entmax.triton_common",
    "entmax.triton_fwd",
    "entmax.triton_bwd",
]


def _jit_functions(module):
    return [obj for obj in vars(module).values() if isinstance(obj, JITFunction) and obj.__module__ == module.__name__]


def _allowed(value) -> bool:
    """What a compiled kernel may read from its module: constexprs, other kernels / jit helpers, modules (``tl``,
    ``math``), Triton's own language objects (dtypes, builtins), and plain Python builtins resolved at compile time."""
    if isinstance(value, (tl.constexpr, JITFunction, types.ModuleType, tl.dtype)):
        return True
    mod = getattr(value, "__module__", "") or ""
    return mod.startswith("triton") or inspect.isbuiltin(value) or value in (range, len, min, max, int, float)


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_jit_functions_read_only_constexpr_globals(name):
    module = importlib.import_module(f"hf_sparse_attn.ops.{name}")
    fns = _jit_functions(module)
    assert fns, f"no @triton.jit function found in {name}"
    bad = []
    for fn in fns:
        code = fn.fn.__code__
        names = set(code.co_names)
        for const in code.co_consts:  # nested comprehensions / lambdas
            if isinstance(const, types.CodeType):
                names |= set(const.co_names)
        for n in sorted(names):
            if n in fn.fn.__globals__ and not _allowed(fn.fn.__globals__[n]):
                bad.append(f"{fn.__name__} reads {n} = {fn.fn.__globals__[n]!r}")
    assert not bad, "module globals a compiled kernel cannot read (wrap them in tl.constexpr): " + "; ".join(bad)
