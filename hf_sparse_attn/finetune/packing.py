"""Padding-free micro-batches (``--packing``): the sequences of a micro-batch concatenated into one row.

:func:`pack` gives what ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives for the
same sequences (tensors instead of lists): ``input_ids`` / ``labels`` / ``position_ids`` of shape (1, T) with T the
sum of the real lengths, ``position_ids`` restarting at 0 per sequence, the first label of every sequence set to
-100 (so no token predicts across a boundary), and the varlen kwargs ``cu_seq_lens_q/k`` + ``max_length_q/k``.
The model's loss (mean over the scored tokens) is then the padded batch's loss: the same tokens are scored, with
the same predictions, since a right-padded causal row never sees its padding.

:func:`check_packable` refuses models whose sequence mixing is not all attention (recurrent, convolutional or
linear-attention layers carry their state across the boundaries of a packed row) and runs one small packed
forward against the same sequences one by one, so a model that cannot keep packed sequences apart fails before
training, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_sparse_attn.finetune.data import IGNORE_INDEX, Chunk

__all__ = ["PACKABLE_LAYER_TYPES", "check_packable", "pack"]

# ``config.layer_types`` values whose layers are attention layers (the only ones that see the varlen boundaries).
PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def pack(chunks: list[Chunk], device) -> dict[str, Any]:
    """One padding-free row of ``chunks`` (their real tokens only) on ``device``: ``input_ids``, ``labels``,
    ``position_ids`` (1, T) and ``cu_seq_lens_q/k`` (int32, number of sequences + 1), ``max_length_q/k``."""
    lengths = [c.num_tokens for c in chunks]
    ids = torch.cat([c.input_ids[:n] for c, n in zip(chunks, lengths, strict=True)])
    labels = torch.cat([c.labels[:n] for c, n in zip(chunks, lengths, strict=True)])
    starts = torch.tensor([0, *lengths]).cumsum(0)
    labels[starts[:-1]] = IGNORE_INDEX  # the first token of a sequence is never a target
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = starts.to(device=device, dtype=torch.int32)
    return {
        "input_ids": ids[None].to(device),
        "labels": labels[None].to(device),
        "position_ids": positions[None].to(device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def _non_attention_layers(config) -> list[str]:
    text = config.get_text_config()
    kinds = sorted({str(t) for t in getattr(text, "layer_types", None) or []} - set(PACKABLE_LAYER_TYPES))
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:  # Llama 4: chunked layers, whether or not layer_types names them
        kinds = [k for k in kinds if k != "chunked_attention"] + [f"chunked_attention (attention_chunk_size={chunk})"]
    return kinds


@torch.no_grad()
def check_packable(model, lengths: tuple[int, ...] = (7, 12), atol: float | None = None) -> None:
    """Raise ValueError (naming ``--packing``) when ``model`` (patched) cannot train on packed sequences: layers
    that are not plain attention, an error on a packed forward, or packed logits that differ from the logits of
    the same sequences run one by one by more than ``atol`` (default 1e-3 in fp32, 5e-2 in 16-bit)."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    others = _non_attention_layers(config)
    if others:
        raise ValueError(
            f"--packing: model type {model_type!r} has layers of type {', '.join(others)}, which do not keep "
            f"packed sequences apart; packing needs models whose layers are all {' / '.join(PACKABLE_LAYER_TYPES)} "
            "(drop --packing)"
        )
    vocab = config.get_text_config().vocab_size
    weight = next(model.parameters())
    device = weight.device
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(min(5, vocab - 1), vocab, (n,), generator=g) for n in lengths]
    batch = pack([Chunk(s, s.clone()) for s in seqs], device)
    batch.pop("labels")
    was_training = model.training
    model.eval()
    try:
        packed = model(**batch, use_cache=False).logits[0].float()
        alone = torch.cat([model(input_ids=s[None].to(device), use_cache=False).logits[0].float() for s in seqs])
    except Exception as err:
        raise ValueError(f"--packing: model type {model_type!r} fails on a packed batch "
                         f"({type(err).__name__}: {err}); drop --packing") from err
    finally:
        model.train(was_training)
    if atol is None:
        atol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    worst = float((packed - alone).abs().max())
    if worst > atol:
        raise ValueError(f"--packing: model type {model_type!r} mixes packed sequences (logits differ from the "
                         f"sequences run one by one by {worst:.3g} > {atol:g}); drop --packing")
