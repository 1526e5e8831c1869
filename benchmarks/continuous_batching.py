"""transformers' continuous batching (``generate_batch``) with a patched model, side by side with the unpatched one.

    .venv/bin/python benchmarks/continuous_batching.py --model smollm2 --lengths 8000 7168 6144 5120 4096 3072 2048 1024

Prompts: one passphrase needle in real prose per prompt (:mod:`hf_sparse_attn.testing.prose`; each prompt its own
passphrase, needle depth and text), chat template, greedy. Configs, one after the other on the same model object:

* ``sdpa`` — the unpatched model (transformers' sdpa continuous batching);
* ``dense`` — ``patch_model(method="dense", continuous_batching=True)``: must give ``sdpa``'s tokens;
* ``bfla`` — ``patch_model(method="bfla", continuous_batching=True)`` with its defaults: prefill chunks of at least
  ``min_seq_len`` queries run sparse (the scheduler serves requests in order and cuts prefills to
  ``--max-batch-tokens`` per step, so the longest prompts come first); the patched layers' mean density of every
  forward whose longest sequence ran sparse is recorded (``PatchHandle.stats()``).

Then every prompt alone through ``model.generate`` (dense, patched): continuous batching must give each prompt's
tokens alone. Reports wall time and generated tokens per second per config, the answers (needle found or not) and
the token comparisons; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from hf_sparse_attn import patch_model  # noqa: E402
from hf_sparse_attn.models import load  # noqa: E402
from hf_sparse_attn.testing.prose import answered, needle_prompt, numbered_passphrase  # noqa: E402


def make_prompts(tokenizer, lengths: list[int]) -> list[dict]:
    out = []
    for i, n in enumerate(lengths):
        needle = numbered_passphrase(i)
        p = needle_prompt(tokenizer, n, depth=(0.15 + 0.23 * i) % 0.9, needle=needle)
        ids = tokenizer(p["input"], add_special_tokens=p["add_special_tokens"])["input_ids"]
        out.append({"ids": ids, "needle": needle, "tokens": len(ids), "depth": p["depth"]})
    return out


def cb_config(prompts: list[dict], new_tokens: int, max_batch_tokens: int) -> ContinuousBatchingConfig:
    """A paged cache that holds every request at once (the default sizes it from the machine's memory)."""
    page = 256
    pages = sum(-(-(p["tokens"] + new_tokens) // page) for p in prompts) + len(prompts)
    return ContinuousBatchingConfig(page_size=page, num_blocks=pages, max_batch_tokens=max_batch_tokens)


def run_batch(model, prompts, new_tokens: int, max_batch_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ``generate_batch`` over every prompt, after a short untimed warm-up batch. -> (tokens, seconds)."""
    warm = [{"ids": prompts[0]["ids"][:64], "tokens": 64}]
    model.generate_batch([warm[0]["ids"]], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                         continuous_batching_config=cb_config(warm, 2, max_batch_tokens))
    eos = model.generation_config.eos_token_id  # both runs stop at the model's end of turn, as generate does
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch([p["ids"] for p in prompts], generation_config=gen,
                               continuous_batching_config=cb_config(prompts, new_tokens, max_batch_tokens))
    seconds = time.perf_counter() - t0
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))], seconds


def run_alone(model, prompts, new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p["ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def prefill_densities(model, handle) -> tuple[list[float], object]:
    """Record the patched layers' mean density after every forward whose stats came from a sparse prefill chunk."""
    seen: list[float] = []

    def hook(*_):
        layers = handle.stats()["layers"].values()
        dens = [v["density"] for v in layers if v.get("path") == "sparse" and v.get("density") is not None]
        if dens:
            seen.append(sum(dens) / len(dens))

    return seen, model.register_forward_hook(hook)


def _number_option(text: str) -> tuple[str, int | float]:
    key, _, value = text.partition("=")
    number = float(value)
    return key, int(number) if number.is_integer() and "." not in value else number


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8000, 7168, 6144, 5120, 4096, 3072, 2048, 1024])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--bfla", nargs="*", default=[], type=_number_option, metavar="KEY=NUMBER",
                    help="bfla options (e.g. min_seq_len=1024 keep_mass=0.97)")
    ap.add_argument("--skip-alone", action="store_true", help="do not run each prompt alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model, tok = load(args.model, dtype=torch.float32)
    model.eval()
    model.set_attn_implementation("sdpa")
    prompts = make_prompts(tok, args.lengths)
    result: dict = {"model": args.model, "lengths": [p["tokens"] for p in prompts], "threads": torch.get_num_threads(),
                    "configs": {}}

    def record(name, tokens, seconds, extra=None):
        texts = [tok.decode(t, skip_special_tokens=True) for t in tokens]
        result["configs"][name] = {
            "seconds": round(seconds, 2),
            "tokens_per_second": round(sum(len(t) for t in tokens) / seconds, 2),
            "answered": [answered(x, p["needle"]) for x, p in zip(texts, prompts, strict=True)],
            "texts": texts, "tokens": tokens, **(extra or {}),
        }
        print(f"{name:6s} {seconds:8.1f} s  answered {sum(result['configs'][name]['answered'])}/{len(prompts)}",
              flush=True)

    tokens, seconds = run_batch(model, prompts, args.new_tokens, args.max_batch_tokens)
    record("sdpa", tokens, seconds)
    handle = patch_model(model, method="dense", continuous_batching=True)
    tokens, seconds = run_batch(model, prompts, args.new_tokens, args.max_batch_tokens)
    record("dense", tokens, seconds)
    if not args.skip_alone:
        result["alone"] = run_alone(model, prompts, args.new_tokens)
    handle = patch_model(model, method="bfla", continuous_batching=True, **dict(args.bfla))
    densities, hook = prefill_densities(model, handle)
    tokens, seconds = run_batch(model, prompts, args.new_tokens, args.max_batch_tokens)
    hook.remove()
    record("bfla", tokens, seconds, {"prefill_densities": [round(d, 3) for d in densities]})
    handle.remove()

    cfg = result["configs"]
    result["dense_equals_sdpa"] = cfg["dense"]["tokens"] == cfg["sdpa"]["tokens"]
    if "alone" in result:
        result["batch_equals_alone"] = [a == b for a, b in zip(cfg["dense"]["tokens"], result["alone"], strict=True)]
    result["bfla_answers_equal_dense"] = cfg["bfla"]["answered"] == cfg["dense"]["answered"]
    result["speed_vs_sdpa"] = {k: round(cfg["sdpa"]["seconds"] / v["seconds"], 3) for k, v in cfg.items()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("configs", "alone")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
