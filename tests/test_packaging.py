"""Every Python package of the source tree is listed in pyproject.toml, so a wheel (not only the editable install the
tests run from) ships it; and a Python started in the checkout can import the package."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_source_package_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join((name, *rel.parts)))
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"


def test_import_from_the_repository_root():
    """``python -c`` / ``python -m`` in the checkout put its root first on sys.path: no folder there may shadow a
    module transformers imports (transformers >= 5.25 imports the Hub's ``kernels`` package with modeling_utils,
    which a top-level ``kernels/`` folder hid: ``import hf_sparse_attn`` raised ImportError)."""
    code = "import hf_sparse_attn, hf_sparse_attn.ops.block_sparse.triton_fwd, transformers.modeling_utils; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert not (ROOT / "kernels").exists(), "a top-level kernels/ folder shadows the package transformers imports"
