"""A byte-level stand-in tokenizer for tiny random-weight models (which ship no tokenizer).

It only serves plumbing tests of the runner: ids are ``3 + byte % (vocab_size - 3)`` so every id fits the tiny
vocabulary; decoding is lossy when ``vocab_size < 259``. Real evaluations use the model's own tokenizer.
"""

from __future__ import annotations

import torch


class ByteTokenizer:
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int):
        if vocab_size < 16:
            raise ValueError(f"vocab_size={vocab_size} is too small for ByteTokenizer (need >= 16)")
        self.span = min(256, vocab_size - 3)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [3 + b % self.span for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None, **_):
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes((int(i) - 3) % 256 for i in ids if int(i) >= 3 or not skip_special_tokens)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text
