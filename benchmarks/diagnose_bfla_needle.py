"""Why bfla loses a needle that dense finds: per layer and KV head, on prose needle prompts of our own format.

Modes (SmolLM2 by default, fp32, CPU)::

    # 1. find a prompt bfla loses: texts x depths, dense vs bfla answers
    .venv/bin/python benchmarks/diagnose_bfla_needle.py search --length 6144 --texts network,data --depths 0.37,0.5
    # 2. diagnose one prompt: per-layer/KV-head needle-block keeps and attention-output error on the dense run's Q/K/V,
    #    hidden-state drift of the bfla run, and which layer groups lose the answer when only they run bfla
    .venv/bin/python benchmarks/diagnose_bfla_needle.py diagnose --length 6144 --text network --depth 0.37
    # 3. the same diagnosis on one eval sample (RULER prompt; the needles are the sample's answer values)
    .venv/bin/python benchmarks/diagnose_bfla_needle.py sample --samples OUT/samples/niah_multivalue_8192.jsonl \
        --sample-id niah_multivalue-8192-3 --max-new 64

Per layer (on the *dense* run's Q/K/V, so every number is the error one layer adds on its own):

* ``err_all`` / ``err_needle``: relative attention-output error ``||O_bfla - O_dense||_F / ||O_dense||_F`` of each KV
  head's query group, over all rows / over the needle sentence's rows;
* ``keep_needle``: fraction of the query blocks after the needle (last, dense block excluded) whose kept list holds
  the needle's key block(s); with several needles (``sample`` mode: one per answer value) the smallest over them;
* ``ret_mass``: the dense attention mass the question rows (the last block) give to the needle tokens (which heads
  retrieve the needle);
* ``density`` per KV head.

Then the bfla run itself: the relative hidden-state difference to dense after every layer, at the needle tokens and at
the last token; and ablations: bfla on one layer group only (the rest dense), answer found or not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _load(model_name: str):
    from hf_sparse_attn.models import load

    model, tok = load(model_name, dtype=torch.float32)
    model.eval()
    return model, tok


def _answer(model, tok, prompt: dict, max_new: int) -> tuple[str, float]:
    from hf_sparse_attn.eval.decode import eos_ids, greedy_decode

    ids = tok(prompt["input"], add_special_tokens=prompt["add_special_tokens"], return_tensors="pt").input_ids
    new, prefill_s, _ = greedy_decode(model, ids, max_new, eos_ids(model, tok))
    return tok.decode(new, skip_special_tokens=True).strip(), prefill_s


def _run(model, tok, prompt, method: str, max_new: int, **conf):
    from hf_sparse_attn import patch_model

    handle = None if method == "dense" else patch_model(model, method=method, **conf)
    try:
        text, secs = _answer(model, tok, prompt, max_new)
        density = handle.stats()["density"] if handle is not None else 1.0
    finally:
        if handle is not None:
            handle.remove()
    return text, secs, density


def search(args) -> list[dict]:
    from hf_sparse_attn.testing import prose

    model, tok = _load(args.model)
    rows = []
    conf = _bfla_conf(args)
    for text in args.texts.split(","):
        for depth in [float(d) for d in args.depths.split(",")]:
            p = prose.needle_prompt(tok, args.length, depth=depth, text=text, chat_template=args.chat_template)
            d_ans, d_s, _ = _run(model, tok, p, "dense", args.max_new)
            b_ans, b_s, dens = _run(model, tok, p, "bfla", args.max_new, **conf)
            row = {
                "text": text, "depth": depth, "tokens": p["tokens"], "dense": d_ans, "bfla": b_ans,
                "dense_ok": prose.answered(d_ans), "bfla_ok": prose.answered(b_ans), "density": dens,
                "dense_s": d_s, "bfla_s": b_s,
            }
            rows.append(row)
            flag = "LOST" if row["dense_ok"] and not row["bfla_ok"] else ""
            print(f"{text:12s} depth {depth:.2f} {p['tokens']:5d} tok | dense {d_ans!r:28s} | bfla {b_ans!r:28s} "
                  f"density {dens:.3f} {flag}", flush=True)
    return rows


def _bfla_conf(args) -> dict:
    conf = {"keep_mass": args.keep_mass}
    for item in args.set or []:
        k, _, v = item.partition("=")
        conf[k] = json.loads(v) if v[:1] in "0123456789-[" else v
    return conf


def _layer_analysis(q, k, v, scale, cfg, spans, n_last: int) -> dict:
    """Numbers of one layer on its dense Q/K/V (see the module docstring); ``spans``: token ``[start, end)`` of each
    needle."""
    from hf_sparse_attn.methods import bfla

    o_d = bfla.dense_attention(q, k, v, None, scale=scale, causal=True)
    o_s, plan = bfla.bfla_attention(q, k, v, scale=scale, config=cfg)
    hkv, hq, sq = k.shape[1], q.shape[1], q.shape[2]
    rep = hq // hkv
    bs = cfg.block_size
    nq = plan.counts.shape[-1]
    rows = [t for n0, n1 in spans for t in range(n0, n1)]
    valid = plan.valid.sum()
    # dense attention of the question rows (last n_last rows) on the needle tokens, per query head
    s = (q[0, :, -n_last:].float() @ k[0].repeat_interleave(rep, 0).float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n_last, sq, dtype=torch.bool).triu(sq - n_last + 1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    ret = p[:, :, rows].sum(-1).mean(-1)  # (Hq,)
    heads = []
    for h in range(hkv):
        g = slice(h * rep, (h + 1) * rep)
        dd, ds = o_d[0, g], o_s[0, g]
        keeps = []
        for n0, n1 in spans:  # per needle: share of the later (sparse) query blocks that keep its key block(s)
            nblocks = range(n0 // bs, (n1 - 1) // bs + 1)
            later = range(nblocks[-1] + 1, nq - cfg.dense_last_blocks)
            kept = sum(
                any(b in plan.ids[0, h, i, : int(plan.counts[0, h, i])].tolist() for b in nblocks) for i in later
            )
            keeps.append(kept / max(1, len(later)))
        heads.append({
            "density": float(plan.counts[0, h].sum() / valid),
            "err_all": float((ds - dd).norm() / dd.norm()),
            "err_needle": float((ds[:, rows] - dd[:, rows]).norm() / dd[:, rows].norm()),
            "keep_needle": min(keeps),
            "keep_each": keeps,
            "ret_mass": float(ret[g].max()),
        })
    return {"heads": heads}


def diagnose(args) -> dict:
    from hf_sparse_attn.testing import prose

    model, tok = _load(args.model)
    p = prose.needle_prompt(tok, args.length, depth=args.depth, text=args.text, chat_template=args.chat_template)
    print(f"# {args.model}, text {args.text}, depth {args.depth}", flush=True)
    out = _diagnose_prompt(args, model, tok, p, [prose.needle_token_span(tok, p)], prose.answered)
    return {"prompt": {k: p[k] for k in ("tokens", "depth", "text")}, **out}


def value_token_spans(tokenizer, sample: dict) -> list[tuple[int, int]]:
    """Token positions ``[start, end)`` of each answer value of an eval sample inside its prompt (first occurrence;
    a value the prompt does not contain is a ValueError naming it)."""
    enc = tokenizer(sample["input"], add_special_tokens=sample.get("add_special_tokens", True),
                    return_offsets_mapping=True)
    spans = []
    for value in sample["answers"]:
        c0 = sample["input"].find(value)
        if c0 < 0:
            raise ValueError(f"answer {value!r} of sample {sample['sample_id']!r} is not in its prompt")
        toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > c0 and a < c0 + len(value)]
        spans.append((toks[0], toks[-1] + 1))
    return spans


def diagnose_sample(args) -> dict:
    """``diagnose`` on one eval sample (``--samples`` JSONL written by ``hf-sparse-attn eval``, ``--sample-id``);
    the needles are the answer values, "found" is the eval's score of the answer (0-100)."""
    from hf_sparse_attn.eval import ruler
    from hf_sparse_attn.eval.scoring import score_sample

    samples = {s["sample_id"]: s for s in ruler.load_samples(args.samples)}
    if args.sample_id not in samples:
        raise SystemExit(f"--sample-id {args.sample_id!r} is not in {args.samples}; it has {sorted(samples)}")
    s = samples[args.sample_id]
    model, tok = _load(args.model)
    spans = value_token_spans(tok, s)
    print(f"# {args.model}, sample {args.sample_id}, answers {s['answers']}", flush=True)
    out = _diagnose_prompt(args, model, tok, s, spans, lambda ans: score_sample(s, ans))
    return {"sample_id": args.sample_id, "answers": s["answers"], **out}


def _diagnose_prompt(args, model, tok, p: dict, spans: list[tuple[int, int]], found) -> dict:
    """Per-layer analysis on the dense run, hidden drift of the bfla run, layer-group ablations of one prompt
    (``p["input"]``, ``p["add_special_tokens"]``); ``found(answer)`` scores an answer."""
    from transformers import AttentionInterface

    from hf_sparse_attn import integration, patch_model
    from hf_sparse_attn.methods import bfla

    ids = tok(p["input"], add_special_tokens=p["add_special_tokens"], return_tensors="pt").input_ids
    n_last = ids.shape[1] - (ids.shape[1] - 1) // 128 * 128  # rows of the last (dense) query block
    print(f"# {ids.shape[1]} tokens, needle tokens {spans}, bfla {_bfla_conf(args)}", flush=True)
    cfg = bfla.BflaConfig(**{**_bfla_conf(args), "min_seq_len": 0})
    per_layer: dict[int, dict] = {}

    def hook(module, q, k, v, mask, **kw):
        per_layer[module.layer_idx] = _layer_analysis(q.detach(), k.detach(), v.detach(), kw["scaling"], cfg, spans,
                                                      n_last)
        return integration.hf_sparse_attn_forward(module, q, k, v, mask, **kw)

    handle = patch_model(model, method="dense")
    AttentionInterface.register(integration.ATTN_NAME, hook)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            hd = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
    finally:
        integration.register()
        handle.remove()
    print(f"# dense run + per-layer analysis: {time.perf_counter() - t0:.0f}s", flush=True)
    rows = [t for a, b in spans for t in range(a, b)] + [-1]  # needle tokens, then the last token
    hd = [h[0, rows] for h in hd]
    handle = patch_model(model, method="bfla", **_bfla_conf(args))
    try:
        with torch.no_grad():
            hb = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
    finally:
        handle.remove()
    hb = [h[0, rows] for h in hb]
    n = len(rows) - 1
    print("layer | per KV head: density  err_all  err_needle  keep_needle  ret_mass | hidden drift needle / last")
    drift = []
    for i in sorted(per_layer):
        a, b = hd[i + 1], hb[i + 1]
        dn = float((b[:n] - a[:n]).norm() / a[:n].norm())
        dl = float((b[n:] - a[n:]).norm() / a[n:].norm())
        drift.append({"needle": dn, "last": dl})
        cells = "  ".join(
            f"{h['density']:.2f} {h['err_all']:.3f} {h['err_needle']:.3f} {h['keep_needle']:.2f} {h['ret_mass']:.2f}"
            for h in per_layer[i]["heads"]
        )
        print(f"{i:5d} | {cells} | {dn:.3f} / {dl:.3f}", flush=True)
    answers = {}
    for method in ("dense", "bfla") if args.answers else ():
        ans, _, dens = _run(model, tok, p, method, args.max_new, **(_bfla_conf(args) if method == "bfla" else {}))
        answers[method] = {"answer": ans, "found": found(ans), "density": dens}
        print(f"{method}: {ans!r} found={found(ans)} density {dens:.3f}", flush=True)
    ablations = []
    for group in (args.groups or "").split(";"):
        if not group:
            continue
        layers = _parse_layers(group)
        ans, _, dens = _run(model, tok, p, "bfla", args.max_new, layers=layers, **_bfla_conf(args))
        ablations.append({"layers": group, "answer": ans, "found": found(ans), "density": dens})
        print(f"bfla on layers {group:>10s} only: {ans!r} found={found(ans)} density {dens:.3f}", flush=True)
    return {"spans": spans, "layers": per_layer, "drift": drift, "answers": answers, "ablations": ablations}


def _parse_layers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["search", "diagnose", "sample"])
    ap.add_argument("--samples", help="sample mode: the eval's samples JSONL (OUT/samples/TASK_LENGTH.jsonl)")
    ap.add_argument("--sample-id", help="sample mode: the sample_id to diagnose")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=6144)
    ap.add_argument("--texts", default="network,data,concurrency,tools")
    ap.add_argument("--depths", default="0.37")
    ap.add_argument("--text", default="network")
    ap.add_argument("--depth", type=float, default=0.37)
    ap.add_argument("--keep-mass", type=float, default=0.95)
    ap.add_argument("--set", action="append", help="other BflaConfig key=value")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--groups", default="0-9;10-19;20-29", help="';'-separated layer groups for the ablation")
    ap.add_argument("--answers", action="store_true", help="also decode the dense and the bfla answer")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"search": search, "diagnose": diagnose, "sample": diagnose_sample}[args.mode](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
