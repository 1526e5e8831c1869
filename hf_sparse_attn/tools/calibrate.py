"""``hf-sparse-attn calibrate``: measure, per layer and KV head, how bfla's attention-output error grows as the
density falls, and write a profile with the lowest-density ``keep_mass`` under a target error.

The model runs densely on calibration prompts (ordinary technical prose with a needle of our own format,
:mod:`hf_sparse_attn.testing.prose`; never evaluation samples). In every layer bfla may sparsify, the dense run's Q/K/V
go through bfla at each candidate ``keep_mass`` (``levels``; every other option as in the given config, rescues
included), and for each KV head the relative error of its query group's output,
``||O_bfla - O_dense||_F / ||O_dense||_F``, and its density (kept / causal tiles) are recorded. The error is
measured on ``error_rows`` (default 8) sampled query rows per block: the estimate is made once per layer, and each
level only reselects and re-sums the rows' per-key-block softmax parts (SmolLM2 at 8k, 30 layers: 64 s on 2 cores
beside one other job, 7 min 50 s at load 9–12, vs ~75 s per layer, ~37 min, through ``bfla_attention`` per level).
Inputs are the dense hidden states, so each number is the error that one layer adds on its own. Per (layer, KV
head) the profile keeps the level with the lowest mean density whose worst error over the prompts is at most
``target_error`` (1.0 = dense when none is). Usage::

    hf-sparse-attn calibrate --model smollm2 --lengths 8192 --out smollm2.profile.json
    patch_model(model, method="bfla", profile="smollm2.profile.json")
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_LEVELS = (0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995)
DEFAULT_ERROR_ROWS = 8  # query rows per block on which the error is measured (None: all rows, slow)
CALIBRATION_TEXTS = ("tools", "data", "concurrency")  # prose texts; the diagnosis / tests use "network" too


def _layer_errors(
    q, k, v, scale, softcap, base, levels, error_rows: int | None = None
) -> dict[float, tuple[list[float], list[float]]]:
    """{level: (error per KV head, density per KV head)} of one layer on its dense Q/K/V.

    ``error_rows``: query rows per query block on which the error is measured (:func:`error_row_sample`); the
    estimate is made once and only the selection is redone per level, then the sampled rows attend densely and
    inside each level's kept tiles. None: every row, through ``bfla_attention`` itself (slow: the whole sparse
    attention per level)."""
    if error_rows is not None:
        return _layer_errors_sampled(q, k, v, scale, softcap, base, levels, error_rows)
    from hf_sparse_attn.methods import bfla

    o_d = bfla.dense_attention(q, k, v, None, scale=scale, causal=True, softcap=softcap)
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    out = {}
    for level in levels:
        cfg = dataclasses.replace(base, keep_mass=level, min_seq_len=0, profile=None)
        o_s, plan = bfla.bfla_attention(q, k, v, scale=scale, softcap=softcap, config=cfg)
        valid = float(plan.valid.sum())
        errs, dens = [], []
        for h in range(hkv):
            g = slice(h * rep, (h + 1) * rep)
            errs.append(float((o_s[:, g] - o_d[:, g]).norm() / o_d[:, g].norm().clamp_min(1e-30)))
            dens.append(float(plan.counts[:, h].sum()) / (valid * plan.counts.shape[0]))
        out[level] = (errs, dens)
    return out


def error_row_sample(sq: int, block_size: int, per_block: int, seed: int = 0) -> torch.Tensor:
    """Sorted row indices ``(n,)``: ``per_block`` distinct rows of every query block (all rows of a shorter block),
    drawn with a fixed generator, so they are not the estimator's stratum middles (on those the estimate is
    exact and the error would be biased low)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for start in range(0, sq, block_size):
        length = min(block_size, sq - start)
        rows.append(torch.randperm(length, generator=g)[: min(per_block, length)] + start)
    return torch.cat(rows).sort().values


def _layer_errors_sampled(q, k, v, scale, softcap, base, levels, per_block):
    """:func:`_layer_errors` on sampled query rows: the relative error over those rows of each KV head's group.

    Each sampled row's softmax is split per key block once: ``z[row, J]`` (sum of ``exp(s - row max)`` over the
    block) and ``num[row, J]`` (the same weights times V); a level's output is ``sum_kept num / sum_kept z``, the
    dense output the sum over all blocks, so the levels cost only their selection."""
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.ops.bfla_plan.estimate import _row_chunk, _scores
    from hf_sparse_attn.ops.bfla_plan.select import select_plan
    from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, _cdiv, plan_keep

    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep, bs = hq // hkv, base.block_size
    rows = error_row_sample(sq, bs, per_block).to(q.device)
    cfg0 = dataclasses.replace(base, keep_mass=0.5, min_seq_len=0, profile=None)
    mass = bfla.estimate_block_mass(q, k, scale=scale, softcap=softcap, config=cfg0)  # the same for every level
    valid = float(bfla.block_valid(sq, skv, bs, None, q.device).sum()) * b
    keeps, out = {}, {}
    for level in levels:
        counts, ids = select_plan(
            mass, batch=b, kv_heads=hkv, sq=sq, skv=skv, sliding_window=None,
            config=dataclasses.replace(cfg0, keep_mass=level),
        )
        keeps[level] = plan_keep(BflaPlan(counts, ids, None, bs, skv - sq, None))[:, :, rows // bs].float()
        out[level] = [(counts[:, h].sum().item() / valid) for h in range(hkv)]
    del mass
    sq_err = {level: torch.zeros(hkv) for level in levels}
    norm = torch.zeros(hkv)
    step = max(1, _row_chunk(1, hq, skv) // 2)
    for c0 in range(0, rows.numel(), step):
        r = rows[c0 : c0 + step]
        m = r.numel()
        nk = _cdiv(int(r[-1]) + skv - sq + 1, bs)  # causal trimming: the key blocks the chunk's last row sees
        k1 = min(skv, nk * bs)
        s = _scores(q[:, :, r].reshape(b, hkv, rep * m, d), k[:, :, :k1], scale, softcap)
        s = F.pad(s, (0, nk * bs - k1), value=float("-inf")).view(b, hkv, rep * m, nk * bs)
        s.masked_fill_((torch.arange(nk * bs, device=q.device) > (r + skv - sq)[:, None]).repeat(rep, 1),
                       float("-inf"))
        p = (s - s.amax(-1, keepdim=True)).exp_().view(b, hkv, rep * m, nk, bs)
        vb = F.pad(v[:, :, :k1].float(), (0, 0, 0, nk * bs - k1)).view(b, hkv, nk, bs, dv)
        z = p.sum(-1).view(b, hkv, rep, m, nk)
        num = (p.permute(0, 1, 3, 2, 4) @ vb).view(b, hkv, nk, rep, m, dv).permute(0, 1, 3, 4, 2, 5)
        del s, p
        o_d = num.sum(4) / z.sum(4)[..., None]  # (B,Hkv,rep,m,Dv)
        norm += o_d.square().sum((0, 2, 3, 4))
        for level in levels:
            w = keeps[level][:, :, c0 : c0 + m, :nk][:, :, None]  # (B,Hkv,1,m,NK)
            o_s = (num * w[..., None]).sum(4) / (z * w).sum(4)[..., None]
            sq_err[level] += (o_s - o_d).square().sum((0, 2, 3, 4))
    norm = norm.sqrt().clamp_min(1e-30)
    return {level: ((sq_err[level].sqrt() / norm).tolist(), out[level]) for level in levels}


def calibration_inputs(tokenizer, lengths: list[int], prompts: int = 1) -> list[torch.Tensor]:
    """Token ids ``(1, S)`` of the calibration prompts: ``prompts`` per length, prose texts and needles of our own
    (:mod:`hf_sparse_attn.testing.prose`), chat template when the tokenizer has one."""
    from hf_sparse_attn.testing import prose

    out = []
    for n in lengths:
        for i in range(prompts):
            needle = prose.passphrase_needle(word=("cobalt", "maple", "quartz", "ember")[i % 4], number=1000 + 731 * i)
            p = prose.needle_prompt(
                tokenizer, n, depth=0.3 + 0.4 * i / max(1, prompts - 1), needle=needle,
                text=CALIBRATION_TEXTS[i % len(CALIBRATION_TEXTS)],
                chat_template=bool(getattr(tokenizer, "chat_template", None)),
            )
            out.append(tokenizer(p["input"], add_special_tokens=p["add_special_tokens"], return_tensors="pt").input_ids)
    return out


def measure(
    model, inputs: list[torch.Tensor], *, levels=DEFAULT_LEVELS, config=None, progress: bool = True,
    error_rows: int | None = DEFAULT_ERROR_ROWS,
) -> dict[int, dict[float, dict[str, list]]]:
    """Run the model densely on ``inputs`` (token ids ``(1, S)`` each); returns ``{layer: {level: {"error": [[per
    KV head] per input], "density": [[per KV head] per input]}}}`` for every layer bfla may sparsify.
    ``error_rows``: see :func:`_layer_errors`."""
    from tqdm.auto import tqdm
    from transformers import AttentionInterface

    from hf_sparse_attn import integration, patch_model
    from hf_sparse_attn.methods import bfla

    base = config or bfla.BflaConfig()
    levels = tuple(sorted(float(x) for x in levels if x < 1.0))
    handle = patch_model(model, method="dense", layers="all")
    eligible = sum(s.sparse_eligible for s in handle.layers.values())
    handle.remove()
    if eligible == 0:
        raise ValueError("this model has no layer bfla sparsifies (no full-attention layer): nothing to calibrate")
    bar = tqdm(total=len(inputs) * eligible, desc="calibrate", unit="layer", disable=not progress)
    found: dict[int, dict[float, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))

    def hook(module, q, k, v, mask, **kw):
        state = getattr(module, integration.STATE_ATTR, None)
        if state is not None and state.sparse_eligible and q.shape[2] > 1:
            res = _layer_errors(q.detach(), k.detach(), v.detach(), kw["scaling"], kw.get("softcap"), base, levels,
                                error_rows)
            for level, (errs, dens) in res.items():
                found[state.layer_idx][level]["error"].append(errs)
                found[state.layer_idx][level]["density"].append(dens)
            bar.update(1)
        return integration.hf_sparse_attn_forward(module, q, k, v, mask, **kw)

    handle = patch_model(model, method="dense", layers="all")
    AttentionInterface.register(integration.ATTN_NAME, hook)
    try:
        for ids in inputs:
            bar.set_postfix_str(f"{ids.shape[1]} tokens")
            with torch.no_grad():
                model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        integration.register()
        handle.remove()
        bar.close()
    return {layer: dict(v) for layer, v in found.items()}


def choose(found, target_error: float) -> dict[str, dict[str, list[float]]]:
    """Per layer and KV head: the level of lowest mean density whose worst error is ``<= target_error`` (1.0 if
    none). Returns the profile's ``layers`` object."""
    layers = {}
    for layer, by_level in sorted(found.items()):
        hkv = len(next(iter(by_level.values()))["error"][0])
        km, dens, errs = [], [], []
        for h in range(hkv):
            best = (1.0, 1.0, 0.0)  # (density, keep_mass, error): dense
            for level, rec in sorted(by_level.items()):
                err = max(e[h] for e in rec["error"])
                d = sum(x[h] for x in rec["density"]) / len(rec["density"])
                if err <= target_error and d < best[0]:
                    best = (d, level, err)
            dens.append(round(best[0], 4))
            km.append(best[1])
            errs.append(round(best[2], 5))
        layers[str(layer)] = {"keep_mass": km, "density": dens, "error": errs}
    return layers


def calibrate(
    model, tokenizer, lengths: list[int], *, target_error: float = 0.05, levels=DEFAULT_LEVELS, prompts: int = 1,
    config=None, progress: bool = True, inputs: list[torch.Tensor] | None = None,
    error_rows: int | None = DEFAULT_ERROR_ROWS,
) -> dict[str, Any]:
    """Measure (:func:`measure`) and build a profile dict (see :mod:`hf_sparse_attn.methods.bfla.profile`).

    ``inputs``: token ids to calibrate on instead of the prose prompts (``tokenizer`` may then be None).
    ``error_rows``: query rows per block the error is measured on (None: all rows; see :func:`_layer_errors`)."""
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.methods.bfla import profile as prof

    if inputs is not None:
        lengths = sorted({int(ids.shape[1]) for ids in inputs})
    if not lengths or any(int(n) < 128 for n in lengths):
        raise ValueError(f"lengths={lengths!r} is not allowed; allowed: one or more token counts >= 128")
    if not 0.0 < target_error < 1.0:
        raise ValueError(f"target_error={target_error!r} is out of range; allowed: a number in (0, 1)")
    if prompts < 1:
        raise ValueError(f"prompts={prompts!r} is out of range; allowed: an integer >= 1")
    if error_rows is not None and not 1 <= error_rows:
        raise ValueError(f"error_rows={error_rows!r} is out of range; allowed: None (all rows) or an integer >= 1")
    base = config or bfla.BflaConfig()
    t0 = time.perf_counter()
    if inputs is None:
        inputs = calibration_inputs(tokenizer, lengths, prompts)
    found = measure(model, inputs, levels=levels, config=base, progress=progress, error_rows=error_rows)
    text_config = model.config.get_text_config()
    layers = choose(found, target_error)
    return {
        "format": prof.FORMAT,
        "version": prof.VERSION,
        "model_type": text_config.model_type,
        "config_hash": prof.config_hash(text_config),
        "block_size": base.block_size,
        "target_error": target_error,
        "lengths": [int(n) for n in lengths],
        "prompts": prompts,
        "levels": sorted(float(x) for x in levels),
        "error_rows": error_rows,
        "base_config": {k: v for k, v in base.to_dict().items() if k not in ("keep_mass", "profile")},
        "mean_density": sum(sum(e["density"]) / len(e["density"]) for e in layers.values()) / len(layers),
        "seconds": round(time.perf_counter() - t0, 1),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "layers": layers,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-sparse-attn calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local model folder or offline alias (hf_sparse_attn.models)")
    ap.add_argument("--lengths", default="8192", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--target-error", type=float, default=0.05,
                    help="largest relative attention-output error per layer and KV head (default 0.05)")
    ap.add_argument("--levels", default=",".join(str(x) for x in DEFAULT_LEVELS), help="candidate keep_mass values")
    ap.add_argument("--prompts", type=int, default=1, help="calibration prompts per length")
    ap.add_argument("--error-rows", type=int, default=DEFAULT_ERROR_ROWS,
                    help="query rows per block the error is measured on (default %(default)s; 0: all rows, slow)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        levels = [float(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        ap.error("--lengths takes integers and --levels numbers, comma-separated")
    for x in levels:
        if not 0.0 < x <= 1.0:
            ap.error(f"--levels value {x} is out of range; allowed: numbers in (0, 1]")
    from hf_sparse_attn.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    data = calibrate(model, tok, lengths, target_error=args.target_error, levels=levels, prompts=args.prompts,
                     error_rows=args.error_rows or None)
    from hf_sparse_attn.methods.bfla.profile import write_profile

    write_profile(data, args.out)
    print(f"wrote {args.out}: {len(data['layers'])} layers, mean density {data['mean_density']:.3f} at target error "
          f"{args.target_error} ({data['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
