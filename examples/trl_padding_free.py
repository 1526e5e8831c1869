"""Padding-free supervised fine-tuning with TRL's ``SFTTrainer`` on a patched model (entmax or dash).

``SFTConfig(padding_free=True)`` concatenates each batch's sequences into one row with ``position_ids`` restarting
per sequence and passes ``cu_seq_lens_q/k``; the hf_sparse_attn attention runs one call per sequence (no padding,
no O(S²) mask). The model is the offline SmolLM2-135M-Instruct (``hf_sparse_attn.models.load``), the dataset a
handful of texts of mixed lengths built here. Needs ``pip install trl`` (not a dependency of the package).

    HF_HUB_OFFLINE=1 python examples/trl_padding_free.py --method dash --steps 4
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUBJECTS = ["The river", "A small robot", "The old library", "Our team", "The telescope", "A quiet village"]
VERBS = ["noticed", "remembered", "measured", "described", "ignored", "celebrated"]
OBJECTS = ["the first snow", "a strange signal", "the missing key", "an unfinished map", "the long summer"]


def texts(num: int, seed: int = 0) -> list[str]:
    """``num`` short texts of 1 to 24 sentences (mixed lengths, so that padding-free batching saves padding)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(1, 24))]
        out.append(" ".join(sentences))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="entmax", help="hf_sparse_attn method (entmax, dash, ...)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = p.parse_args()

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_sparse_attn import patch_model
    from hf_sparse_attn.models import load

    model, tokenizer = load("smollm2")
    handle = patch_model(model, method=args.method)
    dataset = Dataset.from_dict({"text": texts(4 * args.batch_size * args.steps)})
    config = SFTConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl_padding_free_"),
        padding_free=True,
        max_length=None,  # the texts are short; padding-free batching without packing does not truncate
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32 on CPU (SFTConfig turns bf16 on by default)
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"{args.method}: {len(losses)} padding-free steps, losses {[round(x, 4) for x in losses]}")
    print(f"attention density (last batch, mean over layers): {handle.stats()['density']:.3f}")


if __name__ == "__main__":
    main()
