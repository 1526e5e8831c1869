"""Real-model checks of the vLLM plugin (CPU build of vLLM, run in .venv-vllm): greedy tokens of vLLM's own backend
vs the plugin's methods on needle prompts of our own format (passphrases in prose, hf_sparse_attn.testing.prose), and
what bfla's layers did (path, density) on each prefill chunk.

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python benchmarks/vllm_check.py --model smollm2 \
        --lengths 2048 4096 8192 --configs plain dense bfla

Each config is one engine (vLLM's defaults otherwise: chunked prefill at max_num_batched_tokens 4096 on CPU, prefix
caching on); prompts run one at a time, then all together (``--concurrent``). The models are converted once with
``hf_sparse_attn.models.load`` + ``save_pretrained`` into ``runs/vllm_models/<name>``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

CONFIGS = {
    "plain": None,
    "dense": {"method": "dense"},
    "bfla": {"method": "bfla"},
    "entmax": {"method": "entmax"},
}
NEEDLES = (("cobalt", 7261, "the release vault"), ("juniper", 3905, "the backup server"),
           ("saffron", 5148, "the build cluster"))


def model_folder(name: str) -> str:
    if os.path.isdir(name):
        return name
    out = Path("runs/vllm_models") / name
    if not (out / "config.json").exists():
        from hf_sparse_attn import models

        model, tok = models.load(name)
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    return str(out)


def prompts(folder: str, lengths: list[int], depths: list[float]):
    from transformers import AutoTokenizer

    from hf_sparse_attn.testing.prose import needle_prompt, passphrase_needle

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for n in lengths:
        for depth in depths:
            word, number, subject = NEEDLES[len(out) % len(NEEDLES)]
            needle = passphrase_needle(word, number, subject)
            p = needle_prompt(tok, n, depth=depth, needle=needle, text="network",
                              chat_template=getattr(tok, "chat_template", None) is not None)
            ids = tok(p["input"], add_special_tokens=p["add_special_tokens"])["input_ids"]
            out.append({"length": n, "depth": depth, "ids": ids, "answer": needle.answer})
    return tok, out


def run(folder, config_name, items, args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf_sparse_attn.vllm import worker_report

    kw = dict(model=folder, dtype=args.dtype, max_model_len=max(len(it["ids"]) for it in items) + 64,
              enforce_eager=args.eager, enable_prefix_caching=not args.no_prefix_caching, seed=0,
              disable_log_stats=False)  # the preemption counter (get_metrics)
    if args.batched_tokens:
        kw["max_num_batched_tokens"] = args.batched_tokens
    if args.kv_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_bytes
    extra = CONFIGS[config_name]
    if extra is not None:
        extra = dict(extra, **json.loads(args.options or "{}"))
        kw["additional_config"] = {"hf_sparse_attn": extra}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for it in items:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=it["ids"])], sp, use_tqdm=False)[0]
        rows.append({"length": len(it["ids"]), "depth": it["depth"], "seconds": round(time.perf_counter() - t, 2),
                     "tokens": list(out.outputs[0].token_ids), "answer": it["answer"]})
    report = llm.collective_rpc(worker_report)[0]
    concurrent = None
    if args.concurrent:
        llm.reset_prefix_cache()
        outs = llm.generate([TokensPrompt(prompt_token_ids=it["ids"]) for it in items], sp, use_tqdm=False)
        concurrent = [list(o.outputs[0].token_ids) for o in outs]
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    del llm
    return {"config": config_name, "options": extra, "start_s": round(start, 1), "rows": rows,
            "prefills": report["stats"]["prefills"], "concurrent": concurrent, "preemptions": preemptions}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.35], help="needle depths (one prompt each)")
    ap.add_argument("--configs", nargs="+", default=["plain", "dense", "bfla"], choices=list(CONFIGS))
    ap.add_argument("--options", default=None,
                    help="JSON merged into every plugin config, e.g. '{\"min_seq_len\": 4096}'")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--batched-tokens", type=int, default=None, help="max_num_batched_tokens (default: vLLM's)")
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="kv_cache_memory_bytes (a small cache forces preemption; unset VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True")
    ap.add_argument("--concurrent", action="store_true", help="also run all prompts together (tokens compared)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(worker_report)
    folder = model_folder(args.model)
    tok, items = prompts(folder, args.lengths, args.depths)
    results = [run(folder, c, items, args) for c in args.configs]
    base = results[0]
    for res in results:
        print(f"== {res['config']} {res['options'] or ''} (engine start {res['start_s']} s)")
        for row, ref in zip(res["rows"], base["rows"], strict=True):
            text = tok.decode(row["tokens"], skip_special_tokens=True)
            found = row["answer"] in text
            print(f"  {row['length']:>6} tokens depth {row['depth']:.2f} {row['seconds']:>7.2f} s  same tokens as "
                  f"{base['config']}: {row['tokens'] == ref['tokens']}  answer {'found' if found else 'MISSING'}: "
                  f"{text.strip()!r}")
        for p in res["prefills"]:
            if p.get("vllm"):
                print(f"    prefill q={p['query_len']} kv={p['seq_len']}: vLLM ({p['vllm']})")
            else:
                d = p["density"]
                print(f"    prefill q={p['query_len']} kv={p['seq_len']}: paths {p['paths']} density "
                      f"{'n/a' if d is None else round(d, 3)}")
        if res["concurrent"] is not None:
            alone = [r["tokens"] for r in res["rows"]]
            same = [c == a for c, a in zip(res["concurrent"], alone, strict=True)]
            print(f"  concurrent = alone: {all(same)} ({sum(same)}/{len(same)}); = {base['config']} alone: "
                  f"{res['concurrent'] == [r['tokens'] for r in base['rows']]}; preemptions: {res['preemptions']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
