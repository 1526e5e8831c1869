"""RULER scores of a `finetune` output next to the dense model and the zero-shot method (offline).

    python examples/score_finetuned.py runs/ft --task niah_single_1 --length 4096 --samples 5
"""

import argparse

from hf_sparse_attn import patch_model
from hf_sparse_attn.eval import ruler
from hf_sparse_attn.eval.runner import greedy_decode, score_sample
from hf_sparse_attn.finetune import load_finetuned
from hf_sparse_attn.models import load


def score(model, tok, samples, max_new_tokens: int) -> float:
    scores = []
    for s in samples:
        ids = tok(s["input"], add_special_tokens=s["add_special_tokens"], return_tensors="pt")["input_ids"]
        new, _, _ = greedy_decode(model, ids, min(max_new_tokens, s["max_new_tokens"]), {tok.eos_token_id})
        scores.append(score_sample(s, tok.decode(new, skip_special_tokens=True)))
    return sum(scores) / len(scores)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("output_dir")
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()
    model, tok, handle = load_finetuned(args.output_dir)
    method, config = handle.method.name, handle.config.to_dict()
    samples = ruler.generate_samples(args.task, tok, args.length, args.samples)
    tuned = score(model, tok, samples, args.max_new_tokens)
    base, _ = load(_base_name(args.output_dir))
    base.eval()
    dense = score(base, tok, samples, args.max_new_tokens)
    zero_shot = patch_model(base, method=method, **config)
    zero = score(base, tok, samples, args.max_new_tokens)
    zero_shot.remove()
    print(f"{args.task} @ {args.length}, {args.samples} samples: dense {dense:.1f}, {method} zero-shot {zero:.1f}, "
          f"{method} fine-tuned {tuned:.1f}")


def _base_name(output_dir: str) -> str:
    import json
    from pathlib import Path

    from hf_sparse_attn.finetune import CONFIG_FILE

    return json.loads((Path(output_dir) / CONFIG_FILE).read_text())["args"]["model"]


if __name__ == "__main__":
    main()
