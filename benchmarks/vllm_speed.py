"""Side-by-side speed of the vLLM plugin (CPU build of vLLM, run in .venv-vllm): time to first token and decode
speed of vLLM's own backend against bfla through the plugin, one engine per config, all engines up at once and
their requests alternating within every repetition (same machine state for each).

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=3 .venv-vllm/bin/python benchmarks/vllm_speed.py \
        --model gemma3-270m --length 32768 --reps 2

Configs: ``plain`` (no plugin key: vLLM's attention everywhere), ``bfla`` (the plugin, bfla's defaults), and
``bfla-off`` (the plugin with bfla's ``min_seq_len`` above the prompt: every row runs vLLM's kernel inside the
plugin's timed wrapper). ``bfla-off`` gives the share ``a`` of prefill time spent in the layers bfla serves; ``bfla``
gives their attended density ``d`` and the estimate's share ``e`` (plan time over the same layers' time under vLLM's
kernel); the bound on the speed-up is ``1 / (1 - a + a·(d + e))`` (chunks that run vLLM's kernel in the bfla engine
count with d = 1, e = 0). The prompt is a needle in real prose (:mod:`hf_sparse_attn.testing.prose`); the greedy
tokens of every config are compared with ``plain``'s. Each request runs with the prefix cache reset.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_check import model_folder, prompts  # noqa: E402

CONFIGS = {
    "plain": None,
    "bfla": {"method": "bfla"},
    "bfla-off": {"method": "bfla", "min_seq_len": 1 << 30},
}


def engine(folder: str, config: str, args, max_len: int):
    from vllm import LLM

    kw = dict(model=folder, dtype=args.dtype, max_model_len=max_len, enforce_eager=args.eager, seed=0)
    if args.batched_tokens:
        kw["max_num_batched_tokens"] = args.batched_tokens
    if CONFIGS[config] is not None:  # the config's own keys win over --options (bfla-off keeps its min_seq_len)
        extra = {"log_stats": False, **json.loads(args.options or "{}"), **CONFIGS[config]}
        kw["additional_config"] = {"hf_sparse_attn": extra}
    return LLM(**kw)


def timed(llm, ids: list[int], max_tokens: int, request_id: str) -> tuple[float, float, list[int]]:
    """One request on an empty prefix cache, stepped by hand: (time to first token, seconds per decoded token
    after it, the greedy tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids),
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return first, (total - first) / max(1, len(tokens) - 1), tokens


def prefill_records(llm) -> list[dict]:
    from hf_sparse_attn.vllm import worker_report

    return llm.collective_rpc(worker_report)[0]["stats"]["prefills"]


def bound(off_records: list[dict], bfla_records: list[dict], ttft_off: float) -> dict:
    """``a``, ``d``, ``e`` and the bound from one prefill's records of ``bfla-off`` and ``bfla`` (chunk by chunk)."""
    served = sum(r["attention_seconds"] or 0.0 for r in off_records)
    weighted = plan = 0.0
    for off, rec in zip(off_records, bfla_records, strict=True):
        t = off["attention_seconds"] or 0.0
        if rec.get("vllm") or rec.get("density") is None:
            weighted += t
            continue
        weighted += t * rec["density"]
        plan += sum(s.get("plan_seconds") or 0.0 for s in rec["per_layer"].values())
    a = served / ttft_off
    d, e = weighted / served, plan / served
    return {"a": a, "d": d, "e": e, "bound": 1.0 / (1.0 - a + a * (d + e))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--depth", type=float, default=0.35)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens of the decode-speed request")
    ap.add_argument("--options", default=None, help="JSON merged into the plugin configs")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batched-tokens", type=int, default=None, help="max_num_batched_tokens (default: vLLM's)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(worker_report)
    folder = model_folder(args.model)
    tok, items = prompts(folder, [args.length], [args.depth])
    ids, answer = items[0]["ids"], items[0]["answer"]
    engines = {c: engine(folder, c, args, len(ids) + args.decode_tokens + 8) for c in args.configs}
    load0 = os.getloadavg()[0]
    res = {c: {"ttft": [], "decode_per_token": [], "records": None, "tokens": None} for c in args.configs}
    for rep in range(args.reps):
        for c, llm in engines.items():
            if CONFIGS[c]:
                prefill_records(llm)  # reset the stats
            ttft, per_token, tokens = timed(llm, ids, args.decode_tokens + 1, f"{c}-{rep}")
            res[c]["ttft"].append(ttft)
            res[c]["decode_per_token"].append(per_token)
            res[c]["tokens"] = tokens
            if CONFIGS[c]:
                res[c]["records"] = [r for r in prefill_records(llm) if r["query_len"] > 1]
    summary = {"model": args.model, "prompt_tokens": len(ids), "dtype": args.dtype, "reps": args.reps,
               "load_before": load0, "load_after": os.getloadavg()[0], "configs": {}}
    base = statistics.median(res[args.configs[0]]["ttft"])
    base_dec = statistics.median(res[args.configs[0]]["decode_per_token"])
    for c, r in res.items():
        text = tok.decode(r["tokens"], skip_special_tokens=True)
        summary["configs"][c] = {
            "ttft_s": r["ttft"], "ttft_speedup": base / statistics.median(r["ttft"]),
            "decode_s_per_token": r["decode_per_token"],
            "decode_speed_ratio": base_dec / statistics.median(r["decode_per_token"]),
            "same_tokens_as_first": r["tokens"] == res[args.configs[0]]["tokens"], "answer_found": answer in text,
            "text": text, "prefills": r["records"],
        }
    if "bfla" in res and "bfla-off" in res:
        summary["bound"] = bound(res["bfla-off"]["records"], res["bfla"]["records"],
                                 statistics.median(res["bfla-off"]["ttft"]))
    for c, s in summary["configs"].items():
        print(f"{c:>9}: TTFT {' / '.join(f'{t:.1f}' for t in s['ttft_s'])} s ({s['ttft_speedup']:.2f}x), decode "
              f"{statistics.median(s['decode_s_per_token']) * 1e3:.1f} ms/token ({s['decode_speed_ratio']:.3f}x), "
              f"same tokens: {s['same_tokens_as_first']}, answer found: {s['answer_found']}")
        for p in s["prefills"] or []:
            dens = p.get("density")
            print(f"           chunk q={p['query_len']} kv={p['seq_len']}: "
                  f"{'vLLM' if p.get('vllm') else 'density ' + (f'{dens:.3f}' if dens is not None else 'n/a')}, "
                  f"{(p.get('attention_seconds') or 0):.2f} s in the served layers")
    if "bound" in summary:
        b = summary["bound"]
        print(f"bound: a={b['a']:.3f} d={b['d']:.3f} e={b['e']:.3f} -> {b['bound']:.2f}x")
    print(f"load average (1 min): {summary['load_before']:.2f} before, {summary['load_after']:.2f} after")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
