"""`sparse_attention` (dense) against an explicit softmax reference, and the mask contract."""

import pytest
import torch

from hf_sparse_attn.core.masks import LeftPadding, causal_bool_mask, to_bool_mask
from hf_sparse_attn.functional import sparse_attention
from hf_sparse_attn.ops.dense import dense_attention


def _reference(q, k, v, scale, mask=None, softcap=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.double()).to(q.dtype)


@pytest.mark.parametrize("sq,skv", [(9, 9), (5, 13), (1, 7)])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_dense_matches_reference(sq, skv, window, softcap, hq, hkv):
    q = torch.randn(2, hq, sq, 16)
    k, v = torch.randn(2, hkv, skv, 16), torch.randn(2, hkv, skv, 16)
    out = sparse_attention(q, k, v, method="dense", scale=0.3, softcap=softcap, sliding_window=window)
    ref = _reference(q, k, v, 0.3, causal_bool_mask(sq, skv, window), softcap)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_non_causal_and_bool_mask():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    torch.testing.assert_close(sparse_attention(q, k, v, causal=False), _reference(q, k, v, 8**-0.5), atol=1e-5, rtol=0)
    mask = torch.rand(1, 1, 5, 6) > 0.5
    mask[..., 0, :] = False  # a row with no key: finite zeros
    out = sparse_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and out[:, :, 0].abs().max() == 0
    torch.testing.assert_close(out, _reference(q, k, v, 8**-0.5, mask), atol=1e-5, rtol=0)


def test_fully_masked_rows_are_finite_with_softcap_and_grad():
    q = torch.randn(2, 2, 6, 8, requires_grad=True)
    k, v = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    mask = to_bool_mask(LeftPadding(torch.tensor([0, 4]), 6, 6), 6, 6, causal=True, sliding_window=None, device="cpu")
    out = sparse_attention(q, k, v, attn_mask=mask, softcap=2.0)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_left_padded_prefill_per_row_equals_the_masked_reference(hq, hkv):
    """A left-padded causal prefill (no window, no softcap) runs one causal SDPA call per batch row over its valid
    suffix: the explicit masked reference within fp32 rounding, zeros (and zero gradients) for padding queries,
    a row that is all padding included."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, hq, 11, 8, generator=g, requires_grad=True)
    k = torch.randn(3, hkv, 11, 8, generator=g, requires_grad=True)
    v = torch.randn(3, hkv, 11, 8, generator=g, requires_grad=True)
    lp = LeftPadding(torch.tensor([0, 4, 11]), 11, 11)
    out = dense_attention(q, k, v, lp, scale=0.3)
    mask = to_bool_mask(lp, 11, 11, causal=True, sliding_window=None, device="cpu")
    torch.testing.assert_close(out, _reference(q, k, v, 0.3, mask), atol=1e-5, rtol=1e-5)
    assert (out[1, :, :4] == 0).all() and (out[2] == 0).all()
    out.square().sum().backward()
    assert (q.grad[1, :, :4] == 0).all() and (k.grad[1, :, :4] == 0).all() and (v.grad[2] == 0).all()


def test_gradcheck_dense_softcap_float64():
    q = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attention(a, b, c, softcap=2.0, sliding_window=3), (q, k, v))


def test_left_padding_descriptor_materializes_like_hf():
    lp = LeftPadding(torch.tensor([0, 3]), 5, 5)
    m = to_bool_mask(lp, 5, 5, causal=True, sliding_window=None, device="cpu")
    assert m.shape == (2, 1, 5, 5)
    assert not m[1, 0, :, :3].any() and m[1, 0, 4, 3:].all()
    sliced = lp[:, :, -2:, :]
    m2 = to_bool_mask(sliced, 2, 5, causal=True, sliding_window=None, device="cpu")
    assert torch.equal(m2, m[:, :, -2:, :])
    with pytest.raises(TypeError):
        lp[:, :, :2, :]


def test_bad_shapes_named():
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_attention(q, k, k)
    with pytest.raises(ValueError, match="unknown method"):
        sparse_attention(k, k, k, method="flash")
    with pytest.raises(ValueError, match="attn_mask must be a bool"):
        sparse_attention(k, k, k, attn_mask=torch.zeros(1, 1, 4, 4))


@pytest.mark.parametrize("sq,skv", [(13, 13), (7, 19)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_explicit_banded_chunks_equal_the_full_mask_reference(monkeypatch, sq, skv, window, padded, dtype):
    """The explicit (softcap / fp64) path under a causal mask runs query chunks over only the keys they see: with
    chunks of 4 rows it equals the full-mask reference (offset Sq < Skv, window, left padding with an all-padding
    row, GQA 4/2), in place without autograd and out of place with it, with equal gradients."""
    import hf_sparse_attn.ops.dense as dense_mod

    monkeypatch.setattr(dense_mod, "_BAND_CHUNK", 4)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, sq, 8, generator=g, dtype=dtype)
    k, v = torch.randn(3, 2, skv, 8, generator=g, dtype=dtype), torch.randn(3, 2, skv, 8, generator=g, dtype=dtype)
    lp = LeftPadding(torch.tensor([0, 3, skv]), sq, skv) if padded else None
    mask = to_bool_mask(lp, sq, skv, causal=True, sliding_window=window, device="cpu")
    ref = _reference(q, k, v, 0.3, mask, softcap=2.0)
    with torch.no_grad():
        out = dense_attention(q, k, v, lp, scale=0.3, softcap=2.0, sliding_window=window)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    if padded:
        assert (out[2] == 0).all()
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out_g = dense_attention(qg, kg, vg, lp, scale=0.3, softcap=2.0, sliding_window=window)
    torch.testing.assert_close(out_g, out, atol=tol, rtol=tol)
    out_g.square().sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    _reference(qr, kr, vr, 0.3, mask, softcap=2.0).square().sum().backward()
    for got, want in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
        torch.testing.assert_close(got, want, atol=tol * 10, rtol=tol * 10)
