"""LongBench prompts: the prompt of one record (its task's template, LongBench's middle truncation, the chat
template where LongBench applies it) and its token count, truncated to a token budget."""

from __future__ import annotations

from typing import Any

from hf_sparse_attn.eval.longbench.tasks import DATASET2PROMPT, NO_CHAT_TASKS, V2_PROMPT, V2_TASK, split_task


def truncate_middle(text: str, tokenizer: Any, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of ``text`` (LongBench's middle truncation).

    Tokens are counted without special tokens; text already within the budget is returned unchanged.
    Re-tokenising the result can differ from ``max_tokens`` by a token or two at the seam.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail


def _v2_prompt(record: dict[str, Any]) -> str:
    prompt = V2_PROMPT.replace("$DOC$", str(record["context"]).strip())
    prompt = prompt.replace("$Q$", str(record["question"]).strip())
    for letter in "ABCD":
        prompt = prompt.replace(f"$C_{letter}$", str(record[f"choice_{letter}"]).strip())
    return prompt


def _raw_prompt(base: str, record: dict[str, Any]) -> str:
    if base == V2_TASK:
        return _v2_prompt(record)
    return DATASET2PROMPT[base].format(context=record["context"], input=record["input"])


def _wrap(base: str, prompt: str, tokenizer: Any, chat_template: bool) -> str:
    if not chat_template or base in NO_CHAT_TASKS:
        return prompt
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def uses_chat(base: str, chat_template: bool) -> bool:
    """Whether the prompt of task ``base`` is wrapped in the chat template (never for :data:`NO_CHAT_TASKS`)."""
    return chat_template and base not in NO_CHAT_TASKS


def build_prompt(
    task: str,
    record: dict[str, Any],
    tokenizer: Any = None,
    max_input_tokens: int | None = None,
    chat_template: bool = False,
) -> str:
    """The prompt LongBench feeds the model for one record of the official file.

    Args:
        task: a v1 task (``hotpotqa``), its LongBench-E name (``hotpotqa_e``), or ``longbench_v2``
            (optionally ``longbench_v2:<domain>``); the prompt only depends on the base task.
        record: one line of the official file.
        tokenizer: needed for truncation and the chat template.
        max_input_tokens: middle-truncate the raw prompt (before the chat template, as LongBench does) to
            this many tokens; None: no truncation.
        chat_template: wrap as a user turn with ``tokenizer.apply_chat_template`` (generation prompt
            added), except for the tasks in :data:`NO_CHAT_TASKS`.
    """
    base = split_task(task)[0]
    prompt = _raw_prompt(base, record)
    if max_input_tokens is not None:
        if tokenizer is None:
            raise ValueError("truncation (max_input_tokens) needs a tokenizer")
        prompt = truncate_middle(prompt, tokenizer, max_input_tokens)
    return _wrap(base, prompt, tokenizer, chat_template)


def sized_prompt(
    base: str,
    record: dict[str, Any],
    tokenizer: Any,
    max_input_tokens: int | None,
    chat_template: bool,
    prompt_budget: int | None,
    where: str,
) -> tuple[str, int | None]:
    """Prompt + its token count; truncated so it fits ``prompt_budget`` tokens (template included) if given."""
    add_special = not uses_chat(base, chat_template)
    raw = _raw_prompt(base, record)
    if max_input_tokens is not None:
        raw = truncate_middle(raw, tokenizer, max_input_tokens)
    prompt = _wrap(base, raw, tokenizer, chat_template)
    length = _count(tokenizer, prompt, add_special)
    if prompt_budget is None or length is None or length <= prompt_budget:
        return prompt, length
    raw_tokens = len(tokenizer(raw, add_special_tokens=False)["input_ids"])
    target = raw_tokens - (length - prompt_budget)
    for _ in range(8):  # the decode/encode seam can add a token or two: shrink until it fits
        if target < 2:
            raise ValueError(f"{where}: the prompt template alone does not fit {prompt_budget} prompt tokens")
        prompt = _wrap(base, truncate_middle(raw, tokenizer, target), tokenizer, chat_template)
        length = _count(tokenizer, prompt, add_special)
        if length <= prompt_budget:
            return prompt, length
        target -= max(2, length - prompt_budget)
    raise ValueError(f"{where}: could not truncate the prompt to {prompt_budget} tokens")  # pragma: no cover


def _count(tokenizer: Any, text: str, add_special: bool) -> int | None:
    if tokenizer is None:
        return None
    return len(tokenizer(text, add_special_tokens=add_special)["input_ids"])
