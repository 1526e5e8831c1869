"""Held-out haystacks and needles of the fine-tuning retrieval data (hf_sparse_attn.finetune.data) with SmolLM2's
tokenizer: training haystacks come from other essays than the evaluation's essay haystack."""

from types import SimpleNamespace

import pytest

from hf_sparse_attn.eval import ruler
from hf_sparse_attn.finetune import build_parser
from hf_sparse_attn.finetune.data import _retrieval_sets, essay_split


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.fixture(scope="module")
def essays_installed():
    try:
        ruler.essay_names()
    except ruler.TaskDataMissing as err:
        pytest.skip(str(err))


def test_haystack_essays_and_essay_subset(tokenizer, essays_installed):
    names = ruler.essay_names()
    assert len(names) == 49 and names == sorted(names)
    assert ruler.haystack_essays(0) == [] and ruler.haystack_essays(1) == names[:1]
    eight_k = ruler.haystack_essays(8192)
    assert eight_k == names[: len(eight_k)] and 1 < len(eight_k) < 49
    # a 2k essay-haystack sample of the default haystack reads only essays listed by haystack_essays(2048)
    default = ruler.generate_samples("niah_single_2", tokenizer, 2048, 1)[0]
    assert "essays" not in default
    listed = _shingles(" ".join(ruler.essay_texts(ruler.haystack_essays(2048)).values()))
    others = _shingles(" ".join(ruler.essay_texts(names[len(ruler.haystack_essays(2048)) :]).values()))
    assert _shingles(default["input"]) & listed and not (_shingles(default["input"]) & others - listed)
    # essays=[...]: the haystack is made of those essays only
    last = names[-1]
    s = ruler.generate_samples("niah_single_2", tokenizer, 1024, 1, essays=[last])[0]
    assert s["essays"] == [last] and "hard liquor" not in s["input"]
    assert _shingles(s["input"]) & _shingles(ruler.essay_texts([last])[last])
    with pytest.raises(ValueError, match="not essays of the haystack"):
        ruler.generate_samples("niah_single_2", tokenizer, 1024, 1, essays=["nope.txt"])


def test_training_haystacks_are_held_out(tokenizer, essays_installed):
    args = build_parser().parse_args([
        "--model", "smollm2", "--output-dir", "unused", "--synthetic-retrieval", "--synthetic-tasks",
        "niah_single_2,niah_multikey_1", "--seq-len", "512", "--num-train-samples", "12", "--num-eval-samples", "4",
        "--heldout-length", "4096", "--loss-on", "answer",
    ])
    text_config = SimpleNamespace(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text_config))
    split = essay_split(4096)
    assert split.heldout == ruler.haystack_essays(4096) and not set(split.heldout) & set(split.train)
    train, held = _retrieval_sets(args, tokenizer, model, split)
    assert 0 < len(train) <= 12 and len(held) == 4
    heldout_text = _shingles(" ".join(ruler.essay_texts(split.heldout).values()))
    train_text = _shingles(" ".join(ruler.essay_texts(split.train).values()))
    train_decoded = [tokenizer.decode(c.input_ids) for c in train]
    held_decoded = [tokenizer.decode(c.input_ids) for c in held]
    heldout_only = heldout_text - train_text  # boilerplate lines ("Want to start a startup? ...") are in both
    assert all(not (_shingles(t) & heldout_only) for t in train_decoded)  # no held-out essay in training
    assert all(_shingles(t) & train_text for t in train_decoded)  # essay haystacks, from training essays
    assert all(_shingles(t) & heldout_only for t in held_decoded)  # held-out haystacks from held-out essays
    by_essay = {n: _shingles(x) for n, x in ruler.essay_texts(split.train).items()}
    used = {n for t in train_decoded for n, sh in by_essay.items() if _shingles(t) & sh}
    assert len(used) >= 2  # groups of samples start their haystack at different essays
    # answers only are scored, and no training answer is a held-out answer
    train_answers = {tokenizer.decode(c.input_ids[c.labels != -100]).strip() for c in train}
    held_answers = {tokenizer.decode(c.input_ids[c.labels != -100]).strip() for c in held}
    assert not train_answers & held_answers
