import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# `make test` runs the suite in pytest-xdist workers (one test file per worker at a time): give each worker its share
# of the cores, so that two workers running torch on a 2-core machine do not oversubscribe it (tests that need more
# threads set them themselves).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_accelerate():
    """``finetune.run`` creates an ``Accelerator`` (process-wide singleton state): reset it around each in-process
    run."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# Triton 3.6's interpreter fails on loop bounds computed from tensors (`range(lo, tl.minimum(...))`: "only
# 0-dimensional arrays can be converted to Python scalars"); 3.7 and later run the kernels. Compiled on a GPU, 3.6 is
# fine (the gpu extra asks for >= 3.6).
INTERPRETER_MIN_TRITON = (3, 7)


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs Triton kernels under TRITON_INTERPRET=1 (triton >= 3.7)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("interpreter") is None:
        return
    import triton

    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if version < INTERPRETER_MIN_TRITON:
        pytest.skip(
            f"triton {triton.__version__}: its interpreter cannot run these kernels (tensor loop bounds); "
            f"the interpreted kernel tests need triton >= {'.'.join(map(str, INTERPRETER_MIN_TRITON))}"
        )
