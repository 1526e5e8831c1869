"""bfla: estimator + rescues + compact lists (reference), the CPU sparse path, dispatch and model integration."""

import dataclasses

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.functional import sparse_attention
from hf_sparse_attn.methods import bfla, get_method
from hf_sparse_attn.methods.base import LayerState
from hf_sparse_attn.ops.dense import dense_attention

BS = 16


def _qkv(b=1, hq=4, hkv=2, sq=96, skv=96, d=16, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    # a few "heavy" keys so that the estimate is not flat
    k[:, :, :: max(1, skv // 5)] *= 3.0
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _cfg(**kw):
    base = dict(block_size=BS, keep_mass=0.7, min_seq_len=0, rows_per_block=4, antidiag_stride=4, flat_entropy=1.0)
    base.update(kw)
    return bfla.BflaConfig(**base)


def _masked_dense(q, k, v, plan, scale, softcap, window):
    """dense_attention with the plan's token mask, per KV head (the mask is per KV head)."""
    sq, skv = q.shape[2], k.shape[2]
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    tm = bfla.tile_token_mask(plan, sq, skv, window)
    outs = []
    for h in range(hkv):
        m = tm[:, h : h + 1]
        qh = q[:, h * rep : (h + 1) * rep]
        o = dense_attention(qh, k[:, h : h + 1], v[:, h : h + 1], m, scale=scale, softcap=softcap)
        outs.append(o)
    return torch.cat(outs, 1)


# --------------------------------------------------------------------------------------------- config


def test_config_validation_names_key_value_range():
    with pytest.raises(ValueError, match=r"keep_mass=1\.5.*\(0\.0, 1\.0\]"):
        bfla.BflaConfig(keep_mass=1.5)
    with pytest.raises(ValueError, match=r"block_size=100.*\[16, 32, 64, 128, 256\]"):
        bfla.BflaConfig(block_size=100)
    with pytest.raises(ValueError, match=r"local=-2.*\[-1,"):
        bfla.BflaConfig(local=-2)
    with pytest.raises(ValueError, match=r"sink=1\.5.*integer"):
        bfla.BflaConfig(sink=1.5)
    with pytest.raises(ValueError, match=r"estimator='x'.*rows"):
        bfla.BflaConfig(estimator="x")
    with pytest.raises(ValueError, match=r"unknown config key 'keepmass'"):
        get_method("bfla").make_config(keepmass=0.9)
    with pytest.raises(ValueError, match=r"max_density=0"):
        sparse_attention(*_qkv(), method="bfla", max_density=0)
    with pytest.raises(ValueError, match=r"head_lists='query'.*\['auto', 'group', 'head'\]"):
        bfla.BflaConfig(head_lists="query")


# --------------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize("estimator", bfla.ESTIMATORS)
def test_estimates_are_distributions_over_valid_blocks(estimator):
    q, k, _ = _qkv(sq=80, skv=120)
    cfg = _cfg(estimator=estimator)
    m = bfla.estimate_block_mass(q, k, scale=0.25, softcap=None, sliding_window=None, config=cfg)
    valid = bfla.block_valid(80, 120, BS, None, "cpu")
    assert m.shape == (1, 4, 5, 8)
    torch.testing.assert_close(m.sum(-1), torch.ones(1, 4, 5), atol=1e-5, rtol=0)
    assert (m[..., ~valid] == 0).all()


def test_rows_estimator_with_all_rows_is_the_oracle():
    q, k, _ = _qkv(sq=64, skv=64)
    exact = bfla.exact_block_mass(q, k, scale=0.3, softcap=4.0, block_size=BS)
    # with every row sampled, the rows estimate is the exact block mass
    est = bfla.estimate_block_mass(q, k, scale=0.3, softcap=4.0, config=_cfg(rows_per_block=BS))
    torch.testing.assert_close(est, exact, atol=1e-5, rtol=1e-4)


def test_select_by_mass_smallest_set_and_bounds():
    mass = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert bfla.select_by_mass(mass, 0.8).tolist() == [[True, True, False, False]]
    assert bfla.select_by_mass(mass, 0.81).tolist() == [[True, True, True, False]]
    assert bfla.select_by_mass(mass, 0.5).tolist() == [[True, False, False, False]]
    assert bfla.select_by_mass(mass, 0.99, max_density=0.5).tolist() == [[True, True, False, False]]
    assert bfla.select_by_mass(mass, 0.1, min_blocks=3).tolist() == [[True, True, True, False]]
    assert bfla.select_by_mass(mass, 1.0).all()


def test_lists_are_deterministic_sorted_and_compact():
    q, k, _ = _qkv(b=2, sq=128, skv=128)
    cfg = _cfg()
    p1 = bfla.build_plan(q, k, scale=0.25, softcap=None, sliding_window=None, config=cfg)
    p2 = bfla.build_plan(q.clone(), k.clone(), scale=0.25, softcap=None, sliding_window=None, config=cfg)
    assert p1.counts.dtype == torch.int32 and p1.ids.dtype == torch.int32
    assert p1.counts.shape == (2, 2, 8) and p1.ids.shape == (2, 2, 8, 8)
    assert torch.equal(p1.counts, p2.counts) and torch.equal(p1.ids, p2.ids)
    keep = bfla.plan_keep(p1)
    for b in range(2):
        for h in range(2):
            for i in range(8):
                n = int(p1.counts[b, h, i])
                kept = p1.ids[b, h, i, :n].tolist()
                assert kept == sorted(kept) == torch.nonzero(keep[b, h, i]).flatten().tolist()
    assert float(bfla.plan_density(p1)) < 1.0  # sparsity happens
    # transposed lists hold the same tiles
    tc, tids = bfla.transpose_plan(p1)
    assert torch.equal(tc.sum(-1), p1.counts.sum(-1))


@pytest.mark.parametrize("sq,skv", [(96, 96), (53, 133), (40, 117)])  # offsets 0, 80 (aligned), 77 (unaligned)
def test_rescues_present_in_absolute_coordinates(sq, skv):
    q, k, _ = _qkv(sq=sq, skv=skv)
    cfg = _cfg(keep_mass=0.05, sink=1, local=1, dense_last_blocks=1, flat_entropy=1.0)
    plan = bfla.build_plan(q, k, scale=0.25, softcap=None, sliding_window=None, config=cfg)
    keep = bfla.plan_keep(plan)
    off = skv - sq
    nq = -(-sq // BS)
    valid = bfla.block_valid(sq, skv, BS, None, "cpu")
    for i in range(nq):
        first, last = off + i * BS, off + min(sq, (i + 1) * BS) - 1
        row = keep[..., i, :]
        assert row[..., 0].all(), "sink"
        for j in range(first // BS - 1, last // BS + 1):  # every block overlapping the queries + 1 back
            if j >= 0:
                assert row[..., j].all(), f"local band: query block {i} key block {j}"
        assert not (row & ~valid[i]).any(), "never a non-causal tile"
    assert torch.equal(keep[..., nq - 1, :], valid[nq - 1].expand_as(keep[..., nq - 1, :])), "last block dense"
    # every query row sees its own key (diagonal) in token space
    tm = bfla.tile_token_mask(plan, sq, skv, None)
    diag = tm[..., torch.arange(sq), torch.arange(sq) + off]
    assert diag.all()


def test_rescues_switch_off_and_flat_head_fallback():
    q, k, _ = _qkv(hq=2, hkv=2, sq=128, skv=128)
    off = _cfg(keep_mass=0.05, sink=0, local=-1, dense_last_blocks=0, flat_entropy=1.0, min_blocks=1)
    plan = bfla.build_plan(q, k, scale=0.25, softcap=None, sliding_window=None, config=off)
    assert (plan.counts == 1).all()  # only the top estimated block per row (one query head per KV head)
    q, k, _ = _qkv(sq=128, skv=128)
    # flat heads: a query that is zero gives uniform attention -> the whole KV head goes dense
    qz = q.clone()
    qz[:, :2] = 0  # query heads 0,1 = KV head 0
    qz[:, 2:] *= 8  # KV head 1: sharp
    flat = _cfg(keep_mass=0.05, sink=0, local=-1, dense_last_blocks=0, flat_entropy=0.9)
    plan = bfla.build_plan(qz, k, scale=0.25, softcap=None, sliding_window=None, config=flat)
    valid = plan.valid
    assert torch.equal(plan.counts[0, 0], valid.sum(-1).int())
    assert (plan.counts[0, 1] < valid.sum(-1)).any()


# --------------------------------------------------------------------------------------------- attention


CASES = [
    # (b, hq, hkv, sq, skv, softcap, window, dtype)
    (1, 4, 2, 96, 96, None, None, torch.float32),
    (2, 4, 1, 75, 75, 5.0, None, torch.float32),
    (1, 2, 2, 53, 133, None, None, torch.float32),  # chunked prefill, unaligned query offset
    (1, 4, 2, 100, 100, None, 37, torch.float32),  # sliding window
    (1, 4, 2, 40, 117, 3.0, 20, torch.float64),
]


@pytest.mark.parametrize("case", CASES)
def test_sparse_equals_dense_with_tile_mask_forward_and_grads(case):
    b, hq, hkv, sq, skv, softcap, window, dtype = case
    q, k, v = _qkv(b, hq, hkv, sq, skv, dtype=dtype, grad=True)
    cfg = _cfg(keep_mass=0.5, flat_entropy=1.0, sink=0, local=0, dense_last_blocks=0)
    plan = bfla.build_plan(q, k, scale=0.3, softcap=softcap, sliding_window=window, config=cfg)
    assert float(bfla.plan_density(plan)) < 1.0
    out = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.3, softcap=softcap, sliding_window=window)
    ref = _masked_dense(q, k, v, plan, 0.3, softcap, window)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    gs = torch.autograd.grad((out * g).sum(), (q, k, v))
    gr = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, r in zip(gs, gr, strict=True):
        torch.testing.assert_close(a, r, **tol)


@pytest.mark.parametrize("min_run", [1, 2, 1 << 20], ids=["views", "mixed", "gathered"])
@pytest.mark.parametrize("case", CASES)
def test_inference_fast_path_equals_dense_with_tile_mask(case, min_run, monkeypatch):
    """Without autograd (batch 1) the split path (mask-free SDPA over runs of kept blocks as views and the other
    blocks gathered, an explicit diagonal, merged by LSE) runs."""
    from hf_sparse_attn.ops.block_sparse import cpu as attend_cpu

    monkeypatch.setattr(attend_cpu, "MIN_RUN_BLOCKS", min_run)
    b, hq, hkv, sq, skv, softcap, window, dtype = case
    q, k, v = _qkv(1, hq, hkv, sq, skv, dtype=dtype)
    cfg = _cfg(keep_mass=0.5, flat_entropy=1.0, sink=0, local=0, dense_last_blocks=0)
    plan = bfla.build_plan(q, k, scale=0.3, softcap=softcap, sliding_window=window, config=cfg)
    with torch.no_grad():
        out = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.3, softcap=softcap, sliding_window=window)
    ref = _masked_dense(q, k, v, plan, 0.3, softcap, window)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, ref, **tol)


def test_rows_without_keys_are_zero_not_nan():
    # query offset 77: query block 0 (positions 77..92) overlaps key blocks 4 and 5; keep only block 5
    q, k, v = _qkv(sq=40, skv=117, grad=True)
    keep = torch.zeros(1, 2, 3, 8, dtype=torch.bool)
    keep[:, :, 0, 5] = True
    keep[:, :, 1:, :] = bfla.block_valid(40, 117, BS, None, "cpu")[1:]
    counts, ids = bfla.compact(keep)
    plan = bfla.BflaPlan(counts, ids, bfla.block_valid(40, 117, BS, None, "cpu"), BS, 77)
    with torch.no_grad():
        fast = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.25)
    assert (fast[:, :, :3] == 0).all() and torch.isfinite(fast).all()
    out = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.25)
    assert torch.isfinite(out).all()
    assert (out[:, :, :3] == 0).all()  # positions 77, 78, 79 see no kept key
    ref = _masked_dense(q, k, v, plan, 0.25, None, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_keep_mass_one_equals_dense():
    q, k, v = _qkv(b=2, sq=90, skv=90)
    out = sparse_attention(q, k, v, method="bfla", block_size=BS, keep_mass=1.0, min_seq_len=0, dense_density=1.0)
    ref = dense_attention(q, k, v, None, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- left padding

# (hq, hkv, sq, skv, softcap, window, first_valid): batch 2, row 0 unpadded, row 1's first valid key off the grid
PAD_CASES = [
    (4, 2, 96, 96, None, None, (0, 21)),
    (2, 1, 53, 133, 4.0, None, (0, 91)),  # chunked prefill (offset 80): row 1's first 11 queries are padding
    (4, 2, 100, 100, None, 37, (0, 45)),  # sliding window
]


def _pad_plan(case, grad=False, **kw):
    hq, hkv, sq, skv, softcap, window, fv = case
    q, k, v = _qkv(2, hq, hkv, sq, skv, grad=grad)
    cfg = _cfg(**{"flat_entropy": 1.0, **kw})
    fv = torch.tensor(fv)
    plan = bfla.build_plan(q, k, scale=0.3, softcap=softcap, sliding_window=window, config=cfg, first_valid=fv)
    return q, k, v, plan


@pytest.mark.parametrize("estimator", bfla.ESTIMATORS)
def test_estimates_with_left_padding(estimator):
    """No mass on padded keys; rows of padding queries get none; the unpadded row is unchanged."""
    q, k, _ = _qkv(b=2, sq=80, skv=120)  # offset 40; row 1: keys < 61 and queries 0..20 are padding
    fv = torch.tensor([0, 61])
    cfg = _cfg(estimator=estimator)
    m = bfla.estimate_block_mass(q, k, scale=0.25, config=cfg, first_valid=fv)
    rv = bfla.valid_rows(bfla.block_valid(80, 120, BS, None, "cpu"), 80, 120, BS, fv)
    assert rv.shape == (2, 1, 5, 8) and not rv[1, 0, 0].any() and not rv[1, 0, :, :3].any()
    assert (m[~rv.expand_as(m)] == 0).all()
    torch.testing.assert_close(m[:1], bfla.estimate_block_mass(q[:1], k[:1], scale=0.25, config=cfg))
    if estimator != "antidiag":  # antidiag's query groups of padding queries carry no mass: a proxy
        want = torch.tensor([0.0, 1, 1, 1, 1]).expand(4, 5)
        torch.testing.assert_close(m[1].sum(-1), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", PAD_CASES)
def test_left_padding_plan_per_row(case):
    """All-padding tiles are never kept; the sink starts at the block of the row's first valid key; the local band
    and the dense last query block stay in absolute coordinates; the unpadded row's plan is unchanged."""
    hq, hkv, sq, skv, softcap, window, fv = case
    q, k, _, plan = _pad_plan(case, keep_mass=0.05, sink=1, local=0, dense_last_blocks=1)
    keep = bfla.plan_keep(plan)
    rv = bfla.valid_rows(plan.valid, sq, skv, BS, plan.first_valid)[:, 0]  # (B,NQ,NK)
    assert not (keep & ~rv[:, None]).any()
    assert not keep[1, :, :, : fv[1] // BS].any()  # key blocks of padding only
    off = skv - sq
    for b in range(2):
        for i in range(plan.valid.shape[0]):
            sink, diag = fv[b] // BS, (off + min(sq, (i + 1) * BS) - 1) // BS
            for j in (sink, diag):
                assert torch.equal(keep[b, :, i, j], rv[b, i, j].expand(hkv)), (b, i, j)
    assert torch.equal(keep[:, :, -1], rv[:, None, -1].expand_as(keep[:, :, -1])), "last block dense"
    cfg = _cfg(keep_mass=0.05, sink=1, local=0, dense_last_blocks=1, flat_entropy=1.0)
    row0 = bfla.build_plan(q[:1], k[:1], scale=0.3, softcap=softcap, sliding_window=window, config=cfg)
    assert torch.equal(row0.counts, plan.counts[:1]) and torch.equal(row0.ids, plan.ids[:1])


@pytest.mark.parametrize("case", PAD_CASES)
def test_left_padding_sparse_equals_reference_forward_and_grads(case):
    hq, hkv, sq, skv, softcap, window, fv = case
    q, k, v, plan = _pad_plan(case, grad=True, keep_mass=0.5, sink=1, local=0, dense_last_blocks=0)
    assert float(bfla.plan_density(plan)) < 1.0
    args = (plan.counts, plan.ids, 0.3, softcap or 0.0, window or 0, BS, plan.first_valid)
    out = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.3, softcap=softcap, sliding_window=window)
    ref, _ = bfla.reference_sparse_fwd(q, k, v, *args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _masked_dense(q, k, v, plan, 0.3, softcap, window), atol=1e-5, rtol=1e-5)
    pad_rows = max(0, fv[1] - (skv - sq))
    assert (out[1, :, :pad_rows] == 0).all() and torch.isfinite(out).all()  # padding queries see no key
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = bfla.reference_sparse_bwd(g, q, k, v, *args)[:3]
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    assert (got[1][1, :, : fv[1]] == 0).all() and (got[2][1, :, : fv[1]] == 0).all()  # padded keys: no gradient
    # batch 1 with padding: the inference fast path (split SDPA + explicit softmax)
    row1 = bfla.BflaPlan(plan.counts[1:], plan.ids[1:], plan.valid, BS, plan.q_offset, plan.first_valid[1:])
    with torch.no_grad():
        fast = bfla.sparse_attention_cpu(q[1:], k[1:], v[1:], row1, scale=0.3, softcap=softcap, sliding_window=window)
    torch.testing.assert_close(fast, ref[1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", PAD_CASES)
def test_left_padding_keep_all_equals_dense(case):
    """keep_mass=1.0 on a left-padded batch: the sparse path (not a fallback) equals dense with the same mask."""
    hq, hkv, sq, skv, softcap, window, fv = case
    q, k, v = _qkv(2, hq, hkv, sq, skv, grad=True)
    mask = LeftPadding(torch.tensor(fv), sq, skv)
    layer = LayerState(method=bfla.METHOD, config=_cfg(keep_mass=1.0, dense_density=1.0), layer_idx=0,
                       sparse_eligible=True)
    out = bfla.METHOD.forward(q, k, v, mask, scale=0.3, causal=True, softcap=softcap, sliding_window=window,
                              config=layer.config, layer=layer)
    assert bfla.layer_stats(layer)["density"] == 1.0 and layer.stats["path"] == "sparse"  # the sparse path ran
    ref = dense_attention(q, k, v, mask, scale=0.3, softcap=softcap, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # the reference op over the keep-all plan is the dense result too
    plan = bfla.build_plan(q, k, scale=0.3, softcap=softcap, sliding_window=window, config=_cfg(keep_mass=1.0),
                           first_valid=mask.first_valid)
    ro, _ = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.3, softcap or 0.0, window or 0, BS,
                                      plan.first_valid)
    torch.testing.assert_close(ro, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_dense_paths_and_noncontiguous_query():
    q, k, v = _qkv(sq=64, skv=64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous layout like HF
    layer = LayerState(method=bfla.METHOD, config=_cfg(), layer_idx=0, sparse_eligible=False)
    kw = dict(scale=0.25, causal=True, softcap=None, sliding_window=None, config=_cfg())
    ref = dense_attention(q, k, v, None, scale=0.25)
    torch.testing.assert_close(bfla.METHOD.forward(qt, k, v, None, layer=layer, **kw), ref)  # ineligible layer
    short = bfla.BflaConfig(block_size=BS, min_seq_len=1000)
    torch.testing.assert_close(bfla.METHOD.forward(qt, k, v, None, layer=None, **{**kw, "config": short}), ref)
    m = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    torch.testing.assert_close(bfla.METHOD.forward(qt, k, v, m, layer=None, **kw), ref)  # bool mask -> dense
    # decode (Sq == 1) is dense
    torch.testing.assert_close(
        bfla.METHOD.forward(qt[:, :, -1:], k, v, None, layer=None, **kw), ref[:, :, -1:], atol=1e-6, rtol=1e-5
    )
    # sparse path on the non-contiguous query equals the contiguous one
    a = bfla.METHOD.forward(qt, k, v, None, layer=None, **kw)
    b = bfla.METHOD.forward(q, k, v, None, layer=None, **kw)
    torch.testing.assert_close(a, b)


def test_layer_stats():
    q, k, v = _qkv(sq=96, skv=96)
    layer = LayerState(method=bfla.METHOD, config=_cfg(flat_entropy=1.0, sink=0, local=0, dense_last_blocks=0,
                                                       dense_density=1.0), layer_idx=0, sparse_eligible=True)
    bfla.METHOD.forward(q, k, v, None, scale=0.25, causal=True, softcap=None, sliding_window=None,
                        config=layer.config, layer=layer)
    st = bfla.layer_stats(layer)
    assert 0 < st["density"] < 1 and len(st["density_per_head"]) == 2
    assert all(isinstance(x, float) for x in st["density_per_head"])


# --------------------------------------------------------------------------------------------- model


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    # sharpen attention so that the estimate is not flat for random weights
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def test_tiny_llama_prefill_generate_and_keep_all_equals_dense():
    model = _tiny_llama()
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense_logits = model(ids).logits
    with patch_model(model, method="bfla", block_size=BS, min_seq_len=64, keep_mass=1.0, dense_density=1.0) as handle:
        with torch.no_grad():
            logits = model(ids).logits
        assert handle.stats()["density"] == pytest.approx(1.0)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)

    handle = patch_model(model, method="bfla", block_size=BS, min_seq_len=64, keep_mass=0.6, flat_entropy=1.0,
                         dense_density=1.0)
    with torch.no_grad():
        sparse_logits = model(ids).logits
    st = handle.stats()
    assert 0 < st["density"] < 1
    assert all(0 < layer["density"] < 1 for layer in st["layers"].values())
    assert torch.isfinite(sparse_logits).all()
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 164)
    # chunked prefill goes through the sparse path with a query offset
    out2 = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, prefill_chunk_size=100)
    assert out2.shape == (1, 162)
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense_logits)


def test_tiny_llama_left_padded_batch_runs_sparse():
    model = _tiny_llama()
    ids = torch.randint(3, 128, (2, 160), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 160, dtype=torch.long)
    am[1, :37] = 0  # left padding off the 16-token block grid
    with patch_model(model, method="dense"), torch.no_grad():
        dense_logits = model(input_ids=ids, attention_mask=am).logits
    with patch_model(model, method="bfla", block_size=BS, min_seq_len=64, keep_mass=1.0, dense_density=1.0) as handle:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=am).logits
        assert handle.stats()["density"] == pytest.approx(1.0)
    real = am.bool()
    torch.testing.assert_close(logits[real], dense_logits[real], atol=1e-5, rtol=1e-5)
    with patch_model(model, method="bfla", block_size=BS, min_seq_len=64, keep_mass=0.6, flat_entropy=1.0,
                     dense_density=1.0) as handle:
        with torch.no_grad():
            sparse_logits = model(input_ids=ids, attention_mask=am).logits
        st = handle.stats()
    assert 0 < st["density"] < 1  # the sparse path ran on the padded batch (a fallback reports density 1)
    assert all(0 < layer["density"] < 1 and layer["path"] == "sparse" for layer in st["layers"].values())
    assert torch.isfinite(sparse_logits).all()


def test_tiny_llama_trains_through_sparse_path():
    model = _tiny_llama().train()
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    with patch_model(model, method="bfla", block_size=BS, min_seq_len=64, keep_mass=0.6, flat_entropy=1.0):
        loss = model(ids, labels=ids).loss
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------------------------- flex backend


@pytest.mark.parametrize("softcap,window", [(None, None), (5.0, 200)])  # the second falls back to the gather path
def test_flex_backend_equals_masked_dense(softcap, window):
    q, k, v = _qkv(hq=4, hkv=2, sq=700, skv=770, d=16, seed=3)
    cfg = _cfg(block_size=128, keep_mass=0.3, backend="flex", sink=0, local=0, dense_last_blocks=0)
    with torch.no_grad():
        out, plan = bfla.bfla_attention(q, k, v, scale=0.25, softcap=softcap, sliding_window=window, config=cfg)
        ref = _masked_dense(q, k, v, plan, 0.25, softcap, window)
    assert bfla.plan_density(plan).mean() < 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fv", [(0, 300), (130, 0)], ids=["row1-padded", "row0-padded"])
def test_flex_backend_takes_left_padding(fv, monkeypatch):
    """A left-padded batch through flex equals the masked dense reference over the same plan; padding queries give
    zeros; chunked prefill (offset 70) with the first valid key off the block grid."""
    calls = []
    flex = bfla.sparse_attention_flex
    monkeypatch.setattr(bfla.dispatch, "sparse_attention_flex", lambda *a, **kw: calls.append(1) or flex(*a, **kw))
    q, k, v = _qkv(b=2, hq=4, hkv=2, sq=700, skv=770, d=16, seed=5)
    cfg = _cfg(block_size=128, keep_mass=0.3, backend="flex", sink=1, local=0, dense_last_blocks=0)
    with torch.no_grad():
        out, plan = bfla.bfla_attention(q, k, v, scale=0.25, config=cfg, first_valid=torch.tensor(fv))
        ref, _ = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 128, plan.first_valid)
    assert calls and plan.first_valid is not None and bfla.plan_density(plan).mean() < 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for row, first in enumerate(fv):
        assert (out[row, :, : max(0, first - 70)] == 0).all()


def test_flex_backend_trains_through_the_gather_path_on_cpu():
    q, k, v = _qkv(hq=4, hkv=2, sq=300, skv=340, d=16, grad=True, seed=3)
    flex, plan = bfla.bfla_attention(q, k, v, scale=0.25, config=_cfg(block_size=128, backend="flex"))
    gather, _ = bfla.bfla_attention(q, k, v, scale=0.25, config=_cfg(block_size=128, backend="torch"))
    assert torch.equal(flex, gather)
    flex.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_shape_masks_are_built_once_and_usable_after_inference_mode():
    """block_valid / the rescue mask are memoized per shape (each layer of a prefill reuses them), equal a fresh
    build, and are normal tensors even when first built under inference_mode (training can use them later)."""
    from hf_sparse_attn.ops.bfla_plan.select import _rescue_static
    from hf_sparse_attn.ops.block_sparse.tiles import _block_valid

    _block_valid.cache_clear()
    with torch.inference_mode():
        a = bfla.block_valid(300, 420, 32, 100, "cpu")
    b = bfla.block_valid(300, 420, 32, 100, torch.device("cpu"))
    assert a is b and not a.is_inference()
    assert torch.equal(a, _block_valid.__wrapped__(300, 420, 32, 100, "cpu"))
    cfg = _cfg(block_size=32, sink=2, local=1, dense_last_blocks=1)
    r = bfla.rescue_mask(300, 420, cfg, "cpu")
    assert r is bfla.rescue_mask(300, 420, cfg, "cpu")
    assert torch.equal(r, _rescue_static.__wrapped__(300, 420, 32, 1, 1, 2, "cpu"))
    fv = torch.tensor([0, 150])  # per-row sink on top of the shared part
    rp = bfla.rescue_mask(300, 420, cfg, "cpu", fv)
    assert torch.equal(rp[0, 0], r) and rp[1, 0, :, 4:6].all() and not rp[1, 0, :-1, :2].any()


@pytest.mark.parametrize("sq,skv", [(300, 300), (236, 300), (263, 300)], ids=["prefill", "aligned-offset", "offset"])
def test_inference_fast_path_equals_reference(sq, skv, monkeypatch):
    """Batch 1 without autograd on CPU: mask-free flash over the fully visible tiles and masked flash over the
    partial ones (``_attend_batch``); where the query blocks start on key-block boundaries the partial tile of a
    block is its diagonal tile, else the two tiles its causal edge straddles."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    masked_calls = []

    class Spy:
        def __call__(self, *a, **kw):
            mask = kw.get("attn_mask")
            masked_calls.append(None if mask is None else mask.shape[-1])
            return flash(*a, **kw)

    q, k, v = _qkv(hq=6, hkv=2, sq=sq, skv=skv, d=16, seed=7)
    cfg = _cfg(block_size=32, keep_mass=0.5)
    with torch.no_grad():
        plan = bfla.make_plan(q, k, scale=0.25, config=cfg)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", Spy())
        out = bfla.attend(q, k, v, plan, scale=0.25, config=cfg)
    ref, _ = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 32)
    assert bfla.plan_density(plan).mean() < 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    widths = {w for w in masked_calls if w is not None}
    assert widths  # the partial tiles went through masked flash calls
    assert (widths == {32}) == ((skv - sq) % 32 == 0)  # aligned: one diagonal tile per mask; else tiles that straddle


@pytest.mark.parametrize(
    "b,sq,skv,fv,window,batch",
    [(1, 300, 300, None, None, 16), (2, 236, 300, None, None, 3), (1, 256, 256, None, None, 1),
     (1, 263, 300, None, None, 4), (2, 300, 300, (0, 45), None, 16), (1, 300, 300, None, 70, 16),
     (2, 250, 300, (20, 77), 90, 5)],
    ids=["partial-last-block", "aligned-offset-batch2", "one-block-batches", "offset", "left-padding", "window",
         "padding-window-offset"],
)
def test_batched_pass_equals_one_block_per_call_bit_for_bit(b, sq, skv, fv, window, batch, monkeypatch):
    """The inference pass runs the query blocks of a KV head that share their tile pattern (as many mask-free
    tiles, partial tiles of the same classes: causal diagonal, window edge, left padding) as one batched flash call
    each for the full and the partial tiles (``_attend_batch``): bit for bit what one block per call gives
    (``BATCH_BLOCKS = 1``), the reference within fp32 rounding, in fewer flash calls."""
    from hf_sparse_attn.ops.block_sparse import cpu as attend_cpu

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    calls = []

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return flash(*a, **kw)

    q, k, v = _qkv(b=b, hq=6, hkv=2, sq=sq, skv=skv, d=16, seed=11)
    first_valid = None if fv is None else torch.tensor(fv)
    cfg = _cfg(block_size=32, keep_mass=0.5)
    outs, n_calls = {}, {}
    with torch.no_grad():
        plan = bfla.make_plan(q, k, scale=0.25, sliding_window=window, config=cfg, first_valid=first_valid)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
        for size in (batch, 1):
            monkeypatch.setattr(attend_cpu, "BATCH_BLOCKS", size)
            calls.clear()
            outs[size] = bfla.attend(q, k, v, plan, scale=0.25, sliding_window=window, config=cfg)
            n_calls[size], widest = len(calls), max(calls)
            assert 1 < widest <= batch if size > 1 else widest == 1  # batch sizes of the flash calls
    assert bfla.plan_density(plan).max() < 1  # no dense head: every head took the sparse path
    assert torch.equal(outs[batch], outs[1])
    assert n_calls[batch] < n_calls[1] if batch > 1 else True
    ref, _ = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, window or 0, 32, first_valid)
    torch.testing.assert_close(outs[batch], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "b,hq,hkv,sq,skv,d,bs,r",
    [(1, 4, 2, 1000, 1000, 16, 32, 4), (2, 6, 2, 700, 900, 8, 16, 3), (1, 3, 3, 2048, 2048, 64, 128, 8),
     (1, 2, 1, 200, 333, 4, 16, 16), (1, 4, 1, 513, 513, 8, 32, 5)],
)
def test_fused_cpu_estimate_equals_reference(b, hq, hkv, sq, skv, d, bs, r):
    """The CPU ``rows`` estimate through the flash kernel with ``V`` = the key-block indicator (key spans of ``D``
    blocks, the chunk's own keys under an additive causal mask, merged by log-sum-exp) equals the explicit softmax
    reference within fp32 rounding, with any number of worker threads: GQA, offsets not on a block boundary,
    ``D`` smaller than the number of blocks, partial last blocks, batch 2."""
    from hf_sparse_attn.ops.bfla_plan.estimate import _estimate_rows_fused, estimate_rows

    q, k, _ = _qkv(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, seed=3)
    q, k = q * 2, k * 2  # peaked rows
    ref = estimate_rows(q, k, d**-0.5, None, bs, r, None)
    for workers in (1, 2):
        got = _estimate_rows_fused(q, k, d**-0.5, bs, r, workers)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    got16 = _estimate_rows_fused(q.half(), k.half(), d**-0.5, bs, r)
    torch.testing.assert_close(got16, estimate_rows(q.half(), k.half(), d**-0.5, None, bs, r, None),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("sq,skv,fv", [(1000, 1000, (0, 45)), (700, 900, (0, 333)), (513, 513, (40, 513)),
                                       (200, 333, (150, 0))], ids=["aligned", "offset", "all-padding-row", "deep"])
def test_fused_cpu_estimate_with_left_padding_equals_reference(sq, skv, fv):
    """Left padding in the fused CPU estimate: an additive key mask per batch row on the spans it reaches, blind
    rows (padding queries, spans of padding only) left out: the explicit reference within fp32 rounding, with any
    number of workers, a row that is all padding and padding past the first query included."""
    from hf_sparse_attn.ops.bfla_plan.estimate import _estimate_rows_fused, estimate_rows

    q, k, _ = _qkv(b=2, hq=4, hkv=2, sq=sq, skv=skv, d=16, seed=4)
    first_valid = torch.tensor(fv)
    ref = estimate_rows(q * 2, k * 2, 0.25, None, 32, 4, None, first_valid)
    for workers in (1, 2):
        got = _estimate_rows_fused(q * 2, k * 2, 0.25, 32, 4, workers, first_valid=first_valid)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------- per-query-head lists


@pytest.mark.parametrize("hq,hkv,mode,per_head", [(4, 1, "auto", True), (4, 2, "auto", False), (4, 1, "group", False),
                                                   (4, 2, "head", True), (2, 2, "head", False), (4, 1, None, True),
                                                   (4, 2, None, False)])
def test_head_lists_choice(hq, hkv, mode, per_head):
    """``head_lists="auto"`` (the default, None here): one list per query head only where one KV head serves every
    query head, else one list per KV group."""
    if mode is None:
        mode = bfla.BflaConfig().head_lists
    q, k, _ = _qkv(hq=hq, hkv=hkv)
    plan = bfla.make_plan(q, k, scale=0.3, config=_cfg(head_lists=mode))
    assert plan.counts.shape[1] == (hq if per_head else hkv)
    assert bfla.lists_per_query_head(hq, hkv, _cfg(head_lists=mode)) is per_head


@pytest.mark.parametrize("hkv,window", [(1, None), (2, 37)])
def test_head_lists_are_each_heads_own_selection(hkv, window):
    """Per-query-head lists = the group plan's selection without the union over the group: what every query head
    keeps is a subset of its group's list, and here strictly less in total."""
    q, k, _ = _qkv(hq=4, hkv=hkv, sq=100, skv=100)
    cfg = _cfg(keep_mass=0.5, sink=0, local=0, dense_last_blocks=0)
    kw = dict(scale=0.3, softcap=None, sliding_window=window)
    group = bfla.make_plan(q, k, config=dataclasses.replace(cfg, head_lists="group"), **kw)
    head = bfla.make_plan(q, k, config=dataclasses.replace(cfg, head_lists="head"), **kw)
    ref = bfla.build_plan(q, k.repeat_interleave(4 // hkv, 1), config=cfg, **kw)
    assert torch.equal(head.counts, ref.counts) and torch.equal(head.ids, ref.ids)
    keep_g = bfla.plan_keep(group).repeat_interleave(4 // hkv, 1)
    keep_h = bfla.plan_keep(head)
    assert not (keep_h & ~keep_g).any()
    assert float(bfla.plan_density(head)) < float(bfla.plan_density(group))


@pytest.mark.parametrize("hkv,softcap,window", [(1, None, None), (1, 4.0, 37), (2, None, None)])
def test_head_lists_attention_equals_masked_dense(hkv, softcap, window):
    """Each query head attends exactly inside its own kept tiles: forward and gradients (through the repeat of
    K/V) equal dense attention under the per-head token mask; the no-grad split path too."""
    q, k, v = _qkv(b=2, hq=4, hkv=hkv, sq=96, skv=96, grad=True)
    cfg = _cfg(keep_mass=0.5, sink=0, local=0, dense_last_blocks=0, head_lists="head")
    out, plan = bfla.bfla_attention(q, k, v, scale=0.3, softcap=softcap, sliding_window=window, config=cfg)
    assert plan.counts.shape[1] == 4 and float(bfla.plan_density(plan)) < 1.0
    rep = 4 // hkv
    ref = _masked_dense(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), plan, 0.3, softcap, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        fast = bfla.attend(q[:1], k[:1], v[:1], bfla.make_plan(q[:1], k[:1], scale=0.3, softcap=softcap,
                                                                sliding_window=window, config=cfg),
                           scale=0.3, softcap=softcap, sliding_window=window, config=cfg)
    torch.testing.assert_close(fast, ref[:1], atol=1e-5, rtol=1e-5)
