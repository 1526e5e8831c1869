"""bfla keeps dense answers on needles of our own format in a haystack the RULER generator does not make (Python
standard-library documentation, :mod:`hf_sparse_attn.testing.prose`), on the offline SmolLM2.

The default suite runs a short prompt (2k tokens, bfla forced on with ``min_seq_len=0``) and the default config at
4k and 8k; the 6k prompts of the issue's case are ``slow``.
"""

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.eval.decode import eos_ids, greedy_decode
from hf_sparse_attn.models import load
from hf_sparse_attn.testing import prose


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load("smollm2")
    return model.eval(), tok


def _answer(model, tok, prompt, max_new_tokens=24):
    ids = tok(prompt["input"], add_special_tokens=prompt["add_special_tokens"], return_tensors="pt").input_ids
    new, _, _ = greedy_decode(model, ids, max_new_tokens, eos_ids(model, tok))
    return tok.decode(new, skip_special_tokens=True)


def _dense_and_bfla(model, tok, prompt, **conf):
    dense = _answer(model, tok, prompt)
    with torch.no_grad():
        handle = patch_model(model, method="bfla", **conf)
        try:
            sparse = _answer(model, tok, prompt)
            density = handle.stats()["density"]
        finally:
            handle.remove()
    return dense, sparse, density


def test_prose_prompt_is_sized_and_holds_the_needle(smollm2):
    _, tok = smollm2
    p = prose.needle_prompt(tok, 2048, depth=0.37, text="data")
    assert 1900 <= p["tokens"] <= 2048
    a, b = prose.needle_token_span(tok, p)
    ids = tok(p["input"], add_special_tokens=p["add_special_tokens"]).input_ids
    assert "amber-4417" in tok.decode(ids[a:b])
    assert abs(a / len(ids) - 0.37) < 0.1
    with pytest.raises(ValueError, match="depth"):
        prose.needle_prompt(tok, 2048, depth=1.5)
    with pytest.raises(ValueError, match="text"):
        prose.needle_prompt(tok, 2048, text="novels")


def test_smollm2_prose_passphrase_bfla_answers_as_dense(smollm2):
    model, tok = smollm2
    needle = prose.passphrase_needle("violet", 2861, "the build cache")
    p = prose.needle_prompt(tok, 2048, depth=0.37, needle=needle, text="data")
    dense, sparse, density = _dense_and_bfla(model, tok, p, min_seq_len=0)
    assert prose.answered(dense, needle), f"dense misses the needle: {dense!r}"
    assert sparse == dense
    assert density is not None and density < 0.9, density  # the sparse path really ran


# At 8k SmolLM2 itself no longer recalls this needle (dense stops at "The passphrase for the build cache is:"), so
# there the test checks that bfla gives exactly dense's output; at 4k dense finds it and bfla must too.
@pytest.mark.parametrize("length,text,dense_finds", [(4096, "data", True), (8192, "tools", False)])
def test_smollm2_long_prose_passphrase_bfla_default_answers_as_dense(smollm2, length, text, dense_finds):
    """At 4k and 8k the default config (at 4k with ``min_seq_len`` lowered so that its sparse path runs) keeps dense's
    answer."""
    model, tok = smollm2
    needle = prose.passphrase_needle("violet", 2861, "the build cache")
    p = prose.needle_prompt(tok, length, depth=0.37, needle=needle, text=text)
    dense, sparse, density = _dense_and_bfla(model, tok, p, **({"min_seq_len": 3072} if length < 6144 else {}))
    assert prose.answered(dense, needle) == dense_finds, f"dense's answer changed: {dense!r}"
    assert sparse == dense
    assert density is not None and density < 0.75, density  # the sparse path really ran


@pytest.mark.slow
@pytest.mark.parametrize("text", ["network", "data", "concurrency", "tools"])
def test_smollm2_6k_prose_passphrase_bfla_answers_as_dense(smollm2, text):
    model, tok = smollm2
    p = prose.needle_prompt(tok, 6144, depth=0.37, text=text)
    dense, sparse, density = _dense_and_bfla(model, tok, p, min_seq_len=4096)  # the prompt is just under 6144
    if not prose.answered(dense):
        pytest.skip(f"dense misses the needle on text {text!r}: {dense!r}")
    assert prose.answered(sparse), f"bfla loses the needle dense finds (density {density:.3f}): {sparse!r}"
