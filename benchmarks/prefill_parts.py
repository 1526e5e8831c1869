"""Where an end-to-end prefill's time goes: wall time per part of the model, unpatched vs patched, side by side.

Forward hooks time every decoder layer's ``self_attn`` and ``mlp``; for bfla the method's own stages are timed
too (``make_plan``: estimate + selection; ``attend``: the sparse pass; ``dense path``: layers that run the exact
dense path, e.g. by the ``dense_density`` rule). The methods alternate within each repetition, the first one is a
warm-up; medians per part. Prompts and method specs as ``hf-sparse-attn bench`` takes them
(:data:`hf_sparse_attn.tools.bench.PROMPTS`, :func:`hf_sparse_attn.tools.bench.parse_method`).

    .venv/bin/python benchmarks/prefill_parts.py --length 8192 --reps 3                  # torch's default threads
    .venv/bin/python benchmarks/prefill_parts.py --prompt random --methods "unpatched,bfla,bfla:keep_mass=0.9"
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import torch

from hf_sparse_attn.tools.bench import PROMPTS, parse_method, prompt_batch


@contextlib.contextmanager
def _timed_stages(acc: dict[str, float]):
    """Wrap bfla's dispatch stages so that each call adds its wall time to ``acc``; restored on exit."""
    from hf_sparse_attn.methods.bfla import dispatch

    names = {"make_plan": "bfla plan", "attend": "bfla sparse pass", "_dense": "bfla dense path"}
    saved = {n: getattr(dispatch, n) for n in names}

    def wrap(fn, label):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t0
        return timed

    for n, label in names.items():
        setattr(dispatch, n, wrap(saved[n], label))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dispatch, n, fn)


def _hook_modules(model, acc: dict[str, float]) -> list:
    """Forward pre/post hooks adding each decoder layer's ``self_attn`` and ``mlp`` wall time to ``acc``."""
    handles = []
    for layer in model.model.layers:
        for name in ("self_attn", "mlp"):
            mod, start = getattr(layer, name), {}
            handles.append(mod.register_forward_pre_hook(lambda m, a, s=start: s.__setitem__("t", time.perf_counter())))
            handles.append(mod.register_forward_hook(
                lambda m, a, o, s=start, n=name: acc.__setitem__(n, acc[n] + time.perf_counter() - s["t"])))
    return handles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--prompt", choices=PROMPTS, default="prose")
    p.add_argument("--methods", default="unpatched,bfla", help="comma-separated: unpatched and/or method specs")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = p.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps={args.reps} is not allowed; allowed: an integer >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from hf_sparse_attn import patch_model
    from hf_sparse_attn.models import load

    model, tok = load(args.model)
    model.eval()
    ids, mask = prompt_batch(args.prompt, tok, model.config.vocab_size, args.length)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    acc: dict[str, float] = collections.defaultdict(float)
    rows: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in methods}
    handles = _hook_modules(model, acc)
    print(f"{args.model}, {args.length} tokens ({args.prompt}), {torch.get_num_threads()} threads, "
          f"{args.reps} reps + 1 warm-up")
    try:
        for rep in range(args.reps + 1):
            for m in methods:
                name, config = parse_method(m)
                handle = None if m == "unpatched" else patch_model(model, method=name, **config)
                acc.clear()
                with _timed_stages(acc), torch.no_grad():
                    t0 = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
                    total = time.perf_counter() - t0
                if handle is not None:
                    handle.remove()
                if rep:
                    rows[m]["total"].append(total)
                    for part, t in acc.items():
                        rows[m][part].append(t)
                print(f"  rep {rep} {m}: {total:.2f} s " + " ".join(f"{k} {v:.2f}" for k, v in acc.items()),
                      flush=True)
    finally:
        for h in handles:
            h.remove()
    print("medians (s):")
    for m, parts in rows.items():
        print(f"  {m}: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
