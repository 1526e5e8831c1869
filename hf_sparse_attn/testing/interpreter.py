"""Test-module plumbing for Triton kernel tests: where the kernels run (CUDA, or CPU under ``TRITON_INTERPRET=1``),
the skip mark of a kernel test, and running a module's kernel tests under the interpreter (the variable must be set
before Triton is imported, hence a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if ON_CUDA else "cpu"


def kernel_mark(runner: str):
    """The ``skipif`` mark of a kernel test: it runs on CUDA or under the interpreter, which ``runner`` (the module's
    interpreter test) provides in a subprocess."""
    import pytest

    return pytest.mark.skipif(
        not (INTERPRET or ON_CUDA), reason=f"runs on CUDA, or under TRITON_INTERPRET=1 in {runner} (subprocess)"
    )


def run_kernel_tests_under_interpreter(test_file: str, select: str = "kernel and not interpreter",
                                       timeout: int = 900) -> None:
    """Run the tests of ``test_file`` matching ``-k select`` in a subprocess with ``TRITON_INTERPRET=1``; raise
    ``AssertionError`` with the output's tail unless they ran and passed (none skipped)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", select]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], r.stdout[-2000:]


def interpreter_test(test_file: str) -> Callable[[], None]:
    """The test that runs ``test_file``'s kernel tests under the interpreter in a subprocess (skipped where they run
    directly: on CUDA, or already under the interpreter). Assign it to a ``test_*`` name in the module."""
    import pytest

    @pytest.mark.interpreter
    def test() -> None:
        """Run this module's kernel tests in a subprocess with TRITON_INTERPRET=1 (fp32, fp16; small shapes)."""
        if INTERPRET or ON_CUDA:
            pytest.skip("kernel tests run directly in this process")
        run_kernel_tests_under_interpreter(test_file)

    return test
