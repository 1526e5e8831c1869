"""Passphrase needles in prose through transformers: dense against bfla settings, answers and per-layer densities.

    .venv/bin/python benchmarks/needle_grid.py --model gemma3-270m --lengths 16384 24576 32000 \\
        --depths 0.2 0.45 0.7 0.9 --configs dense bfla bfla:keep_mass=0.98 --out runs/needles_gemma3.json

Each prompt: one passphrase needle (its own word, number and subject) at a relative depth of real prose
(:mod:`hf_sparse_attn.testing.prose`, text ``--text``), chat template where the model has one, greedy decode of
``--new-tokens``. Configs: ``dense`` (the patched exact path), ``bfla`` (its defaults) and ``bfla:key=value,...``
(options). Per prompt and config: the answer text, whether it holds the passphrase, the prefill's per-layer density
(``PatchHandle.stats()`` after the prefill) and the prefill time. One model object, configs patched in turn, each
prompt's configs back to back.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from hf_sparse_attn import patch_model  # noqa: E402
from hf_sparse_attn.models import load  # noqa: E402
from hf_sparse_attn.testing.prose import answered, needle_prompt, numbered_passphrase  # noqa: E402


def parse_config(text: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,key=value`` -> (method, options)."""
    method, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = ast.literal_eval(value)
    return method, options


def prefill_and_answer(model, tok, prompt: dict, new_tokens: int, handle) -> dict:
    """Prefill (timed, stats read right after it), then greedy decode; the answer and the layers' densities."""
    ids = tok(prompt["input"], add_special_tokens=prompt["add_special_tokens"], return_tensors="pt").input_ids
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
        layers = handle.stats()["layers"]
        dens = {i: v.get("density") for i, v in layers.items() if v.get("density") is not None}
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        answer = [int(token)]
        for _ in range(new_tokens - 1):
            step = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
            answer.append(int(token))
            if int(token) == tok.eos_token_id:
                break
    return {"tokens": ids.shape[1], "prefill_seconds": round(seconds, 2), "densities": dens,
            "answer": tok.decode(answer, skip_special_tokens=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 24576, 32000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.45, 0.7, 0.9])
    ap.add_argument("--configs", nargs="+", default=["dense", "bfla", "bfla:keep_mass=0.98"])
    ap.add_argument("--text", default="network")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model, tok = load(args.model, dtype=torch.float32)
    chat = tok.chat_template is not None
    configs = [(c, *parse_config(c)) for c in args.configs]
    rows = []
    for li, n in enumerate(args.lengths):
        for di, depth in enumerate(args.depths):
            j = li * len(args.depths) + di
            needle = numbered_passphrase(j)
            prompt = needle_prompt(tok, n, depth=depth, needle=needle, text=args.text, chat_template=chat)
            for name, method, options in configs:
                handle = patch_model(model, method=method, **options)
                res = prefill_and_answer(model, tok, prompt, args.new_tokens, handle)
                handle.remove()
                res.update(config=name, length=n, depth=round(prompt["depth"], 3), answer_expected=needle.answer,
                           answered=answered(res["answer"], needle))
                rows.append(res)
                mean = sum(res["densities"].values()) / max(1, len(res["densities"]))
                print(f"{res['tokens']:6d} {depth:4.2f} {name:28s} {'yes' if res['answered'] else 'NO ':3s} "
                      f"{mean:5.3f} {res['prefill_seconds']:7.1f}s  {res['answer']!r}", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"model": args.model, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
