"""A tiny random-weight chat model saved as an ordinary Hugging Face folder, with a tokenizer and a chat template.

Servers and pipelines (``hf-sparse-attn serve``, i.e. ``transformers serve``) need a tokenizer with a chat template,
which the ``tiny-*`` aliases lack. :func:`save_tiny_chat_model` writes one next to a tiny model of
:mod:`~hf_sparse_attn.testing.tiny_configs`: a character-level tokenizer (``tokenizers`` WordLevel, one token per
character) over printable ASCII and the newline, padded with ``<extra_i>`` tokens to the tiny vocabulary (128) so
that every id the model emits decodes. Ids 0 / 1 / 2 are the tiny configs' pad / bos / eos tokens, here ``<pad>`` /
``<|im_start|>`` / ``<|im_end|>``; the chat template is ChatML. Built offline; the weights are a function of
``seed``.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_sparse_attn.testing.tiny_configs import VOCAB, tiny_model

__all__ = ["CHAT_TEMPLATE", "save_tiny_chat_model", "tiny_chat_tokenizer"]

_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
_CHARS = ["\n", *(chr(c) for c in range(32, 127))]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_chat_tokenizer():
    """The character-level ``PreTrainedTokenizerFast`` (128 ids, no BOS added) with the ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*_SPECIALS, *_CHARS]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]  # every id the model can emit decodes
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_chat_model(folder: str | os.PathLike, model_type: str = "llama", seed: int = 0) -> Path:
    """Save the tiny ``model_type`` model (``tiny_model(model_type, seed)``, default attention) with
    :func:`tiny_chat_tokenizer` into ``folder``; returns the folder. Loadable with ``from_pretrained`` offline."""
    folder = Path(folder)
    model = tiny_model(model_type, seed=seed, attn_implementation=None)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(str(folder))
    tiny_chat_tokenizer().save_pretrained(str(folder))
    return folder
