"""Running a test module's Triton kernel tests on CPU under ``TRITON_INTERPRET=1`` (the interpreter must be set
before Triton is imported, hence a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_kernel_tests_under_interpreter(test_file: str, select: str = "kernel and not interpreter",
                                       timeout: int = 900) -> None:
    """Run the tests of ``test_file`` matching ``-k select`` in a subprocess with ``TRITON_INTERPRET=1``; raise
    ``AssertionError`` with the output's tail unless they ran and passed (none skipped)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", select]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], r.stdout[-2000:]
