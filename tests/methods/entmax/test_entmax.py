"""α-entmax family: exact row-wise math, the blockwise path, the methods on tiny models (fp32, CPU)."""

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_sparse_attn import patch_model
from hf_sparse_attn.api import set_alpha
from hf_sparse_attn.core.compat import cache_kwargs
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.functional import sparse_attention
from hf_sparse_attn.methods import entmax as E
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.ops.entmax import cpu_backward, cpu_forward, cpu_tau, cpu_tiles, dense_cpu

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny float64 matmuls are dominated by thread hand-off on a loaded 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _set_tile(monkeypatch, tile: int) -> None:
    """The tile size of the CPU path (its query rows and keys per tile), in every module that reads it."""
    for mod in (cpu_tiles, cpu_forward, cpu_backward, cpu_tau, dense_cpu):
        if hasattr(mod, "TILE"):
            monkeypatch.setattr(mod, "TILE", tile)


def _qkv(b=2, hq=4, hkv=2, sq=7, skv=7, d=8, dtype=torch.float32, grad=False, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=F64) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    q = q * std
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]


# ------------------------------------------------------------------------------------------------------------------
# Row-wise entmax (reference)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
def test_rows_sum_to_one_with_exact_zeros_and_match_entmax_package(alpha):
    entmax_pkg = pytest.importorskip("entmax")
    z = torch.randn(5, 6, 40, dtype=F64) * 3
    p = E.entmax(z, alpha)
    assert (p.sum(-1) - 1).abs().max() < 1e-12
    assert (p == 0).any() and (p >= 0).all()
    if alpha == 1.5:
        ref = entmax_pkg.entmax15(z)
    elif alpha == 2.0:
        ref = entmax_pkg.sparsemax(z)
    else:
        ref = entmax_pkg.entmax_bisect(z, alpha, n_iter=100)
    assert (p - ref).abs().max() < 1e-10
    p32 = E.entmax(z.float(), alpha)
    assert (p32.sum(-1) - 1).abs().max() < 1e-5 and (p32 == 0).any()


def test_finite_masking_and_fully_masked_rows():
    z = torch.randn(3, 9, dtype=F64) * 5
    mask = torch.rand(3, 9) > 0.4
    mask[1] = False
    p = E.entmax(z, 1.5, mask)
    assert torch.isfinite(p).all()
    assert (p[~mask] == 0).all() and (p[1] == 0).all()
    assert (p[[0, 2]].sum(-1) - 1).abs().max() < 1e-12


def test_gradcheck_rowwise_with_alpha_gradient():
    z = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    alpha = torch.tensor([1.3, 1.6, 1.9], dtype=F64).reshape(1, 3, 1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z, a: E.entmax(z, a), (z, alpha))
    for a in (1.5, 2.0):
        assert torch.autograd.gradcheck(lambda z, a=a: E.entmax(z, a), (z,))


def test_bad_alpha_raises_naming_alpha():
    for bad in (1.0, 0.5, 2.5, "x"):
        with pytest.raises(ValueError, match="alpha"):
            E.EntmaxConfig(alpha=bad)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"alpha.*\(1\.0, 2\.0\]"):
        sparse_attention(q, k, v, method="entmax", alpha=2.5)
    with pytest.raises(ValueError, match="alpha"):
        E.entmax(torch.zeros(3), 1.0)


# ------------------------------------------------------------------------------------------------------------------
# Blockwise path vs reference
# ------------------------------------------------------------------------------------------------------------------

CASES = [
    # b, hq, hkv, sq, skv, window, softcap
    (2, 4, 2, 13, 13, None, None),
    (1, 4, 1, 5, 23, None, 3.0),  # query offset, GQA 4
    (2, 6, 3, 17, 17, 5, None),  # sliding window
    (1, 2, 2, 1, 19, 6, 2.0),  # decode with window + softcap
]


def _force_path(monkeypatch, path: str) -> None:
    """``lists``: the entry lists (forward) and the per-pair backward; ``dense``: every group of rows of general α
    on its dense rows (τ by :func:`cpu_tau.tau_dense`, all key tiles) and every backward tile chunk on dense tiles;
    ``dense_tiles``: the same, each slice of dense rows on the key tiles holding one of its candidate pairs only;
    ``rows``: the backward on dense row chunks (:mod:`dense_cpu`)."""
    monkeypatch.setattr(dense_cpu, "DENSE_ROWS", -1.0 if path == "rows" else 2.0)
    if path in ("dense", "dense_tiles"):
        monkeypatch.setattr(cpu_forward, "_DENSE_PAIRS", -1.0)
        monkeypatch.setattr(cpu_backward, "_DENSE_ENTRIES", -1.0)
        monkeypatch.setattr(cpu_forward, "_GATHER_TILES", 2.0 if path == "dense_tiles" else -1.0)


PATHS = ["lists", "dense", "dense_tiles", "rows"]


@pytest.mark.parametrize("theta", [1.0, 0.5])  # 0.5: rows made flat, as a learned scale θ < 1 makes them
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_reference_multi_chunk(monkeypatch, alpha, case, path, theta):
    """Forward and gradients equal the reference on every path (:func:`_force_path`)."""
    b, hq, hkv, sq, skv, window, softcap = case
    _force_path(monkeypatch, path)
    monkeypatch.setattr(cpu_tiles, "_CHUNK_ELEMS", 64)  # one tile per chunk
    _set_tile(monkeypatch, 4)  # many tiles
    monkeypatch.setattr(cpu_forward, "SUPPORT_KEYS", 2)  # rows with larger supports take the backward's tile path
    monkeypatch.setattr(cpu_backward, "_ENTRY_SLICE", 5)  # several entry slices, cut at row starts
    monkeypatch.setattr(cpu_tau, "_NARROW", 2)  # rows whose support outgrows the first sorted entries
    q, k, v = _qkv(b, hq, hkv, sq, skv, dtype=F64, grad=True, std=theta)
    kw = dict(alpha=alpha, scale=0.8, softcap=softcap, sliding_window=window)
    out = E.entmax_attention(q, k, v, None, **kw)
    ref = E.entmax_attention_reference(q, k, v, None, **kw)
    assert (out - ref).abs().max() < 1e-10
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, ref_grads, strict=True):
        assert (a - r).abs().max() < 1e-9


@pytest.mark.parametrize("path", PATHS)
def test_asentmax_with_a_negative_beta_equals_the_reference(monkeypatch, path):
    """asentmax with a learned scale θ = δ + β·ln n below 1 (β < 0, as the shipped fine-tune learned: flat rows), α =
    1.25, several chunks: forward and gradients (also of δ and β) equal the reference on the scaled queries."""
    from hf_sparse_attn.methods.entmax.variants import ASEntmaxConfig, _asentmax_forward, _log_n, asentmax_theta

    _force_path(monkeypatch, path)
    monkeypatch.setattr(cpu_tiles, "_CHUNK_ELEMS", 256)
    _set_tile(monkeypatch, 4)
    q, k, v = _qkv(2, 4, 2, 29, 29, dtype=F64, grad=True)
    cfg = ASEntmaxConfig(alpha=1.25, delta_init=1.0, beta_init=-0.2)
    delta = torch.full((4,), 1.0, dtype=F64, requires_grad=True)
    beta = torch.tensor([-0.2, -0.15, -0.1, 0.05], dtype=F64, requires_grad=True)
    layer = type("Layer", (), {"params": None, "stats": {}})()
    theta = asentmax_theta(_log_n(None, q, k, True, None), delta, beta, 1.0)
    assert float(theta.min()) < 0.5
    monkeypatch.setattr("hf_sparse_attn.methods.entmax.variants._asentmax_params", lambda *a: (delta, beta))
    out = _asentmax_forward(q, k, v, None, scale=0.8, causal=True, softcap=None, sliding_window=None, config=cfg,
                            layer=layer)
    ref = E.entmax_attention_reference(q * theta, k, v, None, alpha=1.25, scale=0.8)
    assert (out - ref).abs().max() < 1e-10
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v, delta, beta), g),
                    torch.autograd.grad(ref, (q, k, v, delta, beta), g), strict=True):
        assert (a - r).abs().max() < 1e-9


@pytest.mark.parametrize("alpha", [1.25, 1.1])
def test_dense_chunks_with_flat_and_peaked_kv_heads_equal_the_reference(monkeypatch, alpha):
    """A forward chunk whose KV heads differ (one flat: τ on its dense rows; one peaked: τ on the list of its entries
    above the bound), fp64, with gradients (the support lists of both kinds of rows): equal to the reference."""
    monkeypatch.setattr(cpu_forward, "_DENSE_PAIRS", 0.5)
    _set_tile(monkeypatch, 4)
    monkeypatch.setattr(cpu_forward, "SUPPORT_KEYS", 3)
    merged = []
    merge = cpu_forward._merge
    monkeypatch.setattr(cpu_forward, "_merge", lambda *a: merged.append(1) or merge(*a))
    q, k, v = _qkv(1, 4, 2, 40, 40, dtype=F64)
    q = (q * torch.tensor([0.01, 0.01, 8.0, 8.0], dtype=F64)[None, :, None, None]).requires_grad_()
    k.requires_grad_(), v.requires_grad_()
    out = E.entmax_attention(q, k, v, None, alpha=alpha, scale=0.8)
    ref = E.entmax_attention_reference(q, k, v, None, alpha=alpha, scale=0.8)
    assert merged  # some chunk solved one KV head on its dense rows and the other on a list
    assert (out - ref).abs().max() < 1e-10
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        assert (a - r).abs().max() < 1e-9


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, "per-head"])
@pytest.mark.parametrize("hq,hkv,skv,softcap", [(6, 2, 131, None), (3, 3, 64, None), (4, 1, 67, 2.0)])
def test_one_query_step_equals_the_reference_and_the_chunked_path(monkeypatch, alpha, hq, hkv, skv, softcap):
    """A decode step without padding, mask or window takes the lean one-query forward (counted); its output equals
    the reference (fp64 1e-10, fp32 1e-5), and its τ, support sizes and tile mask those of the chunked path."""
    taken = []
    one_query = cpu_forward._one_query_forward
    monkeypatch.setattr(cpu_forward, "_one_query_forward", lambda *a: taken.append(1) or one_query(*a))
    a = torch.linspace(1.2, 1.9, hq, dtype=F64) if alpha == "per-head" else alpha
    mode = {1.5: 1, 2.0: 2}.get(alpha, 0)
    for dtype, tol in ((F64, 1e-10), (torch.float32, 1e-5)):
        q, k, v = _qkv(2, hq, hkv, 1, skv, dtype=dtype, std=3.0)
        with torch.no_grad():
            out = E.entmax_attention(q, k, v, None, alpha=a, scale=0.8, softcap=softcap)
        ref = E.entmax_attention_reference(q.double(), k.double(), v.double(), None, alpha=a, scale=0.8,
                                           softcap=softcap)
        assert (out.double() - ref).abs().max() < tol
        al = (a if alpha == "per-head" else torch.full((hq,), alpha, dtype=F64)).to(dtype)
        args = (q, k, v, al, torch.full((2, 1), skv), None, None, 0.8, softcap or 0.0, 0, True, mode, True)
        lean = cpu_forward.blockwise_forward(*args)
        chunked = cpu_forward.blockwise_forward(*args, keep_support=True)  # the support lists: not the lean path
        assert (lean[1] - chunked[1]).abs().max() <= 1e3 * tol * chunked[1].abs().max()
        assert torch.equal(lean[3], chunked[3]) and torch.equal(lean[4], chunked[4])
    assert len(taken) == 4  # entmax_attention and the first blockwise call, in fp64 and fp32


@pytest.mark.parametrize("path", ["lists", "rows"])
def test_threaded_backward_is_bit_identical_run_to_run(monkeypatch, path):
    """Work split over worker threads never changes a sum's order: two runs give the same bits (fp32)."""
    _force_path(monkeypatch, path)
    monkeypatch.setattr(cpu_tiles, "_CHUNK_ELEMS", 512)  # several row chunks for the dense backward's workers
    _set_tile(monkeypatch, 4)
    monkeypatch.setattr(cpu_backward, "_ENTRY_SLICE", 7)  # many backward tasks for the workers
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = _qkv(1, 4, 2, 61, 61, dtype=torch.float32, grad=True)
        g = torch.randn(1, 4, 61, q.shape[-1])
        runs = []
        for _ in range(3):
            out = E.entmax_attention(q, k, v, None, alpha=1.5, scale=0.8)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    finally:
        torch.set_num_threads(prev)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("std", [0.05, 3.0])  # flat rows (Newton on the full row) and peaked rows (top-k)
@pytest.mark.parametrize("alpha", [1.1, 1.5, 2.0])
def test_blockwise_fp32_paths(alpha, std):
    q, k, v = _qkv(1, 4, 2, 70, 300, 16, std=std)
    out = E.entmax_attention(q, k, v, None, alpha=alpha)
    ref = E.entmax_attention_reference(q.double(), k.double(), v.double(), None, alpha=alpha)
    assert (out.double() - ref).abs().max() < 1e-5


def _tau_reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """τ of rows ``x`` (R, W) (relative to the row max, -inf masked) by bisection in fp64."""
    e = 1.0 / (alpha - 1.0)
    lo, hi = torch.full(x.shape[:1], -1.0, dtype=F64), torch.zeros(x.shape[:1], dtype=F64)
    for _ in range(200):
        mid = (lo + hi) / 2
        big = (x.double() - mid[:, None]).clamp(min=0).pow(e).sum(-1) > 1
        lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("alpha", [1.01, 1.1, 1.25, 4 / 3, 1.5, 1.75, 2.0])
def test_tau_dense_converges_from_the_lower_bound(alpha, dtype):
    """τ of dense rows (flat ones: a scale below 1; peaked ones; masked keys) from the tile-maxima lower bound: the
    root (against bisection), p = [x - τ]_+^e summing to 1 within the tolerance, d = [x - τ]_+ beside it."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(48, 300, generator=g, dtype=F64) * (alpha - 1.0)
    s[:16] *= 0.3  # flat rows: most entries above τ
    s[16:32] *= 6.0  # peaked rows
    s[::3, 200:] = float("-inf")  # masked keys
    x = (s - s.amax(-1, keepdim=True)).to(dtype)
    em1 = 1.0 / (alpha - 1.0) - 1.0
    tmax = x.view(48, -1, 20).amax(-1)
    tau0 = cpu_tau.initial_tau(tmax, 0, em1, dtype)
    hi = -torch.isfinite(x).sum(-1).to(dtype).pow(-(alpha - 1.0))
    tau, updates, err, total, d, p = cpu_tau.tau_dense(x, torch.minimum(tau0, hi), hi, None, em1, dtype,
                                                       cpu_tau.DenseBuffers())
    ref = _tau_reference(x, alpha)
    assert (tau.double() - ref).abs().max() < (1e-12 if dtype == F64 else 2e-6)
    assert err <= cpu_tau.SUM_TOL[dtype] and (total - 1).abs().max() <= cpu_tau.SUM_TOL[dtype]
    assert torch.allclose(p.sum(-1), total) and torch.equal(d, (x - tau[:, None]).clamp(min=0))
    if alpha <= 1.5 and dtype == torch.float32:
        assert updates <= 3, updates  # Halley's updates from the tile-maxima bound


def test_tau_dense_rows_left_over_by_the_last_evaluation_are_solved_on_their_own(monkeypatch):
    """An evaluation that gives p only as soon as |Σp - 1| < 100 leaves rows above the tolerance: they are gathered,
    solved with slopes, and patched into τ, p, d and the row sums (fp64, against bisection); dead rows stay put."""
    monkeypatch.setattr(cpu_tau, "_LAST_AT", 100.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 256, generator=g, dtype=F64) * 0.25
    x[5] = float("-inf")
    x[5, 0] = 0.0
    x = x - x.amax(-1, keepdim=True)
    live = torch.ones(20, dtype=torch.bool)
    live[7] = False
    x[7] = float("-inf")
    x[7, 0] = 0.0
    hi = -torch.isfinite(x).sum(-1).to(F64).pow(-0.25)
    solved = []
    solve_rows = cpu_tau._solve_rows
    monkeypatch.setattr(cpu_tau, "_solve_rows", lambda xs, *a: solved.append(xs.shape[0]) or solve_rows(xs, *a))
    tau, updates, err, total, d, p = cpu_tau.tau_dense(x, torch.full((20,), -1.0, dtype=F64), hi, live, 3.0, F64,
                                                       cpu_tau.DenseBuffers())
    assert solved and 0 < solved[0] < 19
    ref = _tau_reference(x, 1.25)
    assert (tau - ref)[live].abs().max() < 1e-12 and err <= 1e-13
    assert torch.allclose(p, (x - tau[:, None]).clamp(min=0) ** 4, rtol=1e-12, atol=0)
    assert (total[live] - 1).abs().max() < 1e-13


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
def test_fp32_rows_sum_to_one_before_renormalisation(alpha):
    # the row sums the op divides by (and diag's max |Σp - 1|) come from the exact τ, not from the renormalisation
    for std, sq in ((0.05, 150), (0.3, 300), (1.0, 200), (4.0, 130)):
        q, k, v = _qkv(1, 4, 2, sq, sq, 32, std=std)
        a = torch.full((4,), alpha)
        nv = E.key_counts(None, 1, sq, sq, causal=True, sliding_window=None, device="cpu")
        _out, _tau, norm, _supp, _tiles, diag, _support = torch.ops.hf_sparse_attn.entmax_fwd(
            q, k, v, a, nv, None, None, 32**-0.5, 0.0, 0, True, E.alpha_mode(alpha), False
        )
        assert (norm - 1).abs().max() <= 1e-4 and diag[1] <= 1e-4, (std, float((norm - 1).abs().max()))


@pytest.mark.parametrize("alpha", [1.01, 1.05, 1.25])
def test_tau_newton_on_the_norm_form_converges_in_few_updates(alpha):
    # Newton on h = ‖[x - τ]_+‖_e - 1 (nearly linear) instead of f = Σ [x - τ]_+^e - 1 (a power-e curve): near α = 1
    # the old form took 6-8 updates on these rows; the norm form 2-4, to the same fp32 tolerance
    q, k, v = _qkv(1, 4, 2, 300, 300, 32)
    a = torch.full((4,), alpha)
    nv = E.key_counts(None, 1, 300, 300, causal=True, sliding_window=None, device="cpu")
    out, _tau, norm, _supp, _tiles, diag, _support = torch.ops.hf_sparse_attn.entmax_fwd(
        q, k, v, a, nv, None, None, 32**-0.5, 0.0, 0, True, 0, False
    )
    assert diag[0] <= 4, float(diag[0])
    assert (norm - 1).abs().max() <= 1e-4 and diag[1] <= 1e-4
    ref = E.entmax_attention_reference(q.double(), k.double(), v.double(), None, alpha=alpha)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("e", [0.0, 1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 2.5])
def test_pow_support_integer_exponents_by_multiplication(e):
    # integer exponents (e = 4 / e - 1 = 3 at α = 1.25) are multiplied out; 9 and 2.5 take the exp2/log2 form;
    # all give d^e on the support, exact zeros off it (also for e = 0), and a new tensor
    d = torch.rand(4, 257).mul_(3).sub_(1).clamp_(min=0)
    p = cpu_tiles.pow_support(d, e)
    ref = torch.where(d > 0, d.double().pow(e), 0.0)
    assert p.data_ptr() != d.data_ptr() and torch.equal(p == 0, d == 0)
    assert torch.allclose(p.double(), ref, rtol=2e-6, atol=0)
    # into a given buffer (the dense Newton evaluations reuse one): the same values, written there, d untouched
    d0, buf = d.clone(), torch.full_like(d, float("nan"))
    q = cpu_tiles.pow_support(d, e, buf)
    assert q.data_ptr() == buf.data_ptr() and torch.equal(q, p) and torch.equal(d, d0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_fp32(dtype):
    q, k, v = _qkv(1, 4, 2, 9, 9, 16, dtype=dtype, std=2.0)
    out = E.entmax_attention(q, k, v, None, alpha=1.5)
    assert out.dtype == dtype
    ref = E.entmax_attention_reference(q.float(), k.float(), v.float(), None, alpha=1.5)
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    assert (out.float() - ref).abs().max() < tol


@pytest.mark.parametrize("path", PATHS)
def test_gradients_under_left_padding_and_bool_masks_equal_the_reference(monkeypatch, path):
    _force_path(monkeypatch, path)
    monkeypatch.setattr(cpu_tiles, "_CHUNK_ELEMS", 64)
    _set_tile(monkeypatch, 4)
    q, k, v = _qkv(2, 4, 2, 6, 10, dtype=F64, grad=True)
    alpha = torch.tensor([1.2, 1.5, 1.7, 2.0], dtype=F64, requires_grad=True)
    mask = torch.rand(2, 1, 6, 10, generator=torch.Generator().manual_seed(1)) > 0.5
    mask[1, 0, 2] = False  # a row that sees nothing
    for m, kw in ((LeftPadding(torch.tensor([0, 7]), 6, 10), dict(sliding_window=3)), (mask, dict(softcap=2.0))):
        out = E.entmax_attention(q, k, v, m, alpha=alpha, **kw)
        ref = E.entmax_attention_reference(q, k, v, m, alpha=alpha, **kw)
        g = torch.randn_like(out)
        for a, r in zip(torch.autograd.grad(out, (q, k, v, alpha), g), torch.autograd.grad(ref, (q, k, v, alpha), g),
                        strict=True):
            assert (a - r).abs().max() < 1e-9


def test_dense_backward_is_chosen_near_alpha_one_only():
    q, k, v = _qkv(1, 4, 2, 200, 200, 32)
    nv = E.key_counts(None, 1, 200, 200, causal=True, sliding_window=None, device="cpu")
    for alpha, dense in ((1.01, True), (1.5, False)):
        res = torch.ops.hf_sparse_attn.entmax_fwd(q, k, v, torch.full((4,), alpha), nv, None, None, 32**-0.5, 0.0, 0,
                                                  True, 0, False, True)
        assert dense_cpu.runs_dense(res[6], res[4]) == dense, alpha


def test_masks_left_padding_and_bool_rows_without_keys():
    q, k, v = _qkv(2, 4, 2, 6, 10, dtype=F64, grad=True)
    lp = LeftPadding(torch.tensor([0, 7]), 6, 10)  # row 1: queries 0.. see keys 7..; none is empty here
    out = E.entmax_attention(q, k, v, lp, alpha=1.5, sliding_window=3)
    ref = E.entmax_attention_reference(q, k, v, lp, alpha=1.5, sliding_window=3)
    assert (out - ref).abs().max() < 1e-12
    mask = torch.rand(2, 1, 6, 10) > 0.5
    mask[1, 0, 2] = False  # a row that sees nothing
    out = E.entmax_attention(q, k, v, mask, alpha=1.5, softcap=2.0)
    ref = E.entmax_attention_reference(q, k, v, mask, alpha=1.5, softcap=2.0)
    assert (out - ref).abs().max() < 1e-12 and (out[1, :, 2] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_left_padding_rows_without_keys_are_zero():
    q, k, v = _qkv(2, 2, 1, 8, 8, dtype=torch.float32, grad=True)
    lp = LeftPadding(torch.tensor([0, 5]), 8, 8)
    out = E.entmax_attention(q, k, v, lp, alpha=1.5)
    assert torch.isfinite(out).all() and (out[1, :, :5] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_blockwise_softcap_window_and_alpha_gradient(monkeypatch, path):
    _force_path(monkeypatch, path)
    q, k, v = _qkv(1, 4, 2, 5, 8, 4, dtype=F64, grad=True)
    alpha = torch.tensor([1.3, 1.5, 1.8, 1.95], dtype=F64, requires_grad=True)
    f = lambda q, k, v, a: E.entmax_attention(q, k, v, None, alpha=a, scale=0.9, softcap=2.0, sliding_window=4)
    assert torch.autograd.gradcheck(f, (q, k, v, alpha), fast_mode=True)
    f15 = lambda q, k, v: E.entmax_attention(q, k, v, None, alpha=1.5, softcap=3.0)
    assert torch.autograd.gradcheck(f15, (q, k, v), fast_mode=True)
    ref = lambda q, k, v, a: E.entmax_attention_reference(q, k, v, None, alpha=a, softcap=2.0)
    assert torch.autograd.gradcheck(ref, (q, k, v, alpha), fast_mode=True)


def test_alpha_near_one_approaches_softmax():
    q, k, v = _qkv(1, 4, 2, 12, 12, 16)
    out = E.entmax_attention(q, k, v, None, alpha=1.001)
    dense = dense_attention(q, k, v, None)
    assert (out - dense).abs().max() < 5e-3
    assert (E.entmax_attention(q, k, v, None, alpha=1.5) - dense).abs().max() > 5e-2


@pytest.mark.parametrize("sq", [6, 64])  # 64: K / V whole tiles (no padding copy)
def test_noncontiguous_query_and_opcheck(sq):
    q, k, v = _qkv(2, 4, 2, sq, sq, 8)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # as HF passes them
    assert not qt.is_contiguous() and not vt.is_contiguous()
    for alpha in (1.5, 1.25):
        assert torch.equal(E.entmax_attention(qt, kt, vt, None, alpha=alpha),
                           E.entmax_attention(q, k, v, None, alpha=alpha))
    alpha = torch.full((4,), 1.5)
    nv = torch.arange(1, sq + 1, dtype=torch.float32)[None]
    torch.library.opcheck(
        torch.ops.hf_sparse_attn.entmax_fwd.default, (qt, kt, vt, alpha, nv, None, None, 0.5, 0.0, 0, True, 1, True)
    )


def test_stats_zero_fraction():
    q, k, v = _qkv(1, 4, 2, 16, 16, 8, std=3.0)
    stats = {}
    out = E.entmax_attention(q, k, v, None, alpha=1.5, stats=stats)
    ref_p = E.entmax(
        torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 8**-0.5,
        1.5,
        torch.ones(16, 16, dtype=torch.bool).tril(),
    )
    assert out.shape == q.shape
    allowed = 4 * 16 * 17 // 2
    assert int(stats["allowed"]) == allowed
    assert int(stats["support"]) == int((ref_p > 0).sum())


# ------------------------------------------------------------------------------------------------------------------
# Methods on tiny models
# ------------------------------------------------------------------------------------------------------------------

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0)


def _tiny(arch):
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(
            Gemma2Config(**COMMON, sliding_window=4, query_pre_attn_scalar=16, attn_logit_softcapping=5.0)
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON))
    # Larger q/k weights so attention is peaked (and sparse) rather than uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model.eval()


def _ids(batch=1, length=12, seed=1):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


METHOD_KW = {
    "entmax": {"alpha": 1.5},
    "sparsemax": {},
    "asentmax": {"beta_init": 0.3, "gamma": 1.0},
    "ssmax": {"s_init": 0.5},
}


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("method", ["entmax", "sparsemax", "asentmax", "ssmax"])
def test_prefill_equals_token_by_token_decode(arch, method):
    model = _tiny(arch)
    ids = _ids(length=11)
    handle = patch_model(model, method=method, **METHOD_KW[method])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = cache_kwargs(model, DynamicCache(config=model.config))
        steps = [model(input_ids=ids[:, i : i + 1], **cache, use_cache=True).logits for i in range(ids.shape[1])]
    step = torch.cat(steps, dim=1)
    assert (full - step).abs().max() < 1e-4
    out = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    if method != "ssmax":
        with torch.no_grad():
            model(input_ids=ids)
        st = handle.stats()
        assert 0 < st["density"] < 1
        for entry in st["layers"].values():
            assert abs(entry["density"] + entry["zero_fraction"] - 1) < 1e-12
    handle.remove()


def test_left_padded_batch_no_nan_and_matches_unpadded_rows():
    model = _tiny("llama")
    ids = _ids(batch=2, length=10)
    am = torch.ones_like(ids)
    am[1, :4] = 0
    with torch.no_grad(), patch_model(model, method="entmax"):
        padded = model(input_ids=ids, attention_mask=am).logits
        alone = model(input_ids=ids[1:, 4:]).logits
        gen = model.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.isfinite(padded).all()
    assert (padded[1, 4:] - alone[0]).abs().max() < 1e-4
    assert gen.shape == (2, 13)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_learn_alpha_trains_and_save_load_roundtrip(tmp_path):
    model = _tiny("llama")
    ids = _ids(batch=2, length=16)
    handle = patch_model(model, method="entmax", alpha=1.5, learn_alpha=True)
    params = [p for n, p in model.named_parameters() if "hf_sparse_attn_params" in n]
    assert len(params) == 2 and all(p.shape == (4,) for p in params)
    alpha0 = torch.stack([handle.layers[i].params.alpha() for i in (0, 1)]).detach().clone()
    assert torch.allclose(alpha0, torch.full_like(alpha0, 1.5))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    alpha1 = torch.stack([handle.layers[i].params.alpha() for i in (0, 1)]).detach()
    assert (alpha1 - alpha0).abs().max() > 1e-3
    assert ((alpha1 >= 1.01) & (alpha1 <= 2.0)).all()
    assert "alpha" in handle.stats()["layers"][0]
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    handle.save(tmp_path / "ent")
    handle.remove()
    fresh = _tiny("llama")
    fresh.load_state_dict(model.state_dict(), strict=False)
    h2 = patch_model(fresh, method="entmax", alpha=1.5, learn_alpha=True, from_pretrained=tmp_path / "ent")
    with torch.no_grad():
        after = fresh(input_ids=ids).logits
    assert torch.equal(before, after)
    h2.remove()


@pytest.mark.parametrize("method", ["asentmax", "ssmax"])
def test_variant_parameters_learn_and_roundtrip(tmp_path, method):
    model = _tiny("qwen3")
    ids = _ids(batch=1, length=12)
    handle = patch_model(model, method=method, **METHOD_KW[method])
    params = {n: p for n, p in model.named_parameters() if "hf_sparse_attn_params" in n}
    assert params
    before = {n: p.detach().clone() for n, p in params.items()}
    model.train()
    opt = torch.optim.SGD(params.values(), lr=0.1)
    opt.zero_grad()
    _loss(model, ids).backward()
    opt.step()
    assert any((p - before[n]).abs().max() > 0 for n, p in params.items())
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    handle.save(tmp_path / method)
    handle.remove()
    h2 = patch_model(model, method=method, **METHOD_KW[method], from_pretrained=tmp_path / method)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)
    h2.remove()


@pytest.mark.parametrize("method,kw", [("entmax", {"learn_alpha": True}), ("asentmax", {"beta_init": 0.2})])
def test_gradient_checkpointing_gives_identical_grads(method, kw):
    model = _tiny("gemma2")
    ids = _ids(batch=2, length=10)
    handle = patch_model(model, method=method, **kw)

    def grads(ckpt):
        model.train()
        if ckpt:
            model.gradient_checkpointing_enable()
        model.zero_grad()
        # use_cache=False in both runs: checkpointing forces it, and a cache changes the mask form HF passes
        # (bool tensor vs None), hence the chunk shapes and the float rounding of the matmuls.
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if ckpt:
            model.gradient_checkpointing_disable()
        return out

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and any("hf_sparse_attn_params" in n for n in plain)
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n
    handle.remove()


def test_alpha_schedule_and_set_alpha():
    assert E.alpha_schedule(0, 100) == pytest.approx(1.01)
    assert E.alpha_schedule(50, 100, start=1.0 + 1e-3, end=2.0) == pytest.approx(1.5005)
    assert E.alpha_schedule(500, 100) == pytest.approx(1.5)
    model = _tiny("llama")
    ids = _ids()
    with torch.no_grad():
        handle = patch_model(model, method="entmax", alpha=1.5)
        a = model(input_ids=ids).logits
        set_alpha(model, 2.0)
        assert handle.config.alpha == 2.0
        b = model(input_ids=ids).logits
        handle.remove()
        with patch_model(model, method="sparsemax"):
            c = model(input_ids=ids).logits
        assert torch.allclose(b, c, atol=1e-5) and not torch.allclose(a, b, atol=1e-3)
        handle = patch_model(model, method="entmax", learn_alpha=True)
        set_alpha(handle, 1.2)
        assert torch.allclose(handle.layers[0].params.alpha(), torch.full((4,), 1.2))
        handle.remove()
    with pytest.raises(ValueError, match="alpha"):
        set_alpha(model, 3.0)


def test_variant_configs_validate():
    from hf_sparse_attn.methods.entmax.variants import ASEntmaxConfig, SSMaxConfig

    with pytest.raises(ValueError, match="gamma"):
        ASEntmaxConfig(gamma=0.0)
    with pytest.raises(ValueError, match="alpha"):
        ASEntmaxConfig(alpha=1.0)
    with pytest.raises(ValueError, match="ref_len"):
        SSMaxConfig(ref_len=1)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown config key"):
        sparse_attention(q, k, v, method="ssmax", alpha=1.5)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entmax_rows_equals_entmax_with_ties_masks_and_empty_rows(alpha, dtype):
    from hf_sparse_attn.ops.entmax.naive import entmax, entmax_rows

    g = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 5.0, 30.0):
        z = torch.randn(120, 37, generator=g, dtype=dtype) * scale
        keep = torch.rand(120, 37, generator=g) < 0.6
        keep[:5] = False  # rows without a valid entry: zeros
        keep[5:10] = False
        keep[5:10, 3] = True  # one valid entry: probability 1
        z[10:20, :5] = 2.0  # ties at the top
        for mask in (None, keep):
            got = entmax_rows(z, alpha, mask)
            torch.testing.assert_close(got, entmax(z, alpha, mask), atol=2e-6, rtol=0)
    assert (got[:5] == 0).all() and (got[5:10, 3] == 1).all()


@pytest.mark.parametrize("length", [40, 200])
def test_cpu_autocast_bf16_forward_backward(length):
    """Under CPU autocast (bf16 mixed precision, e.g. a Trainer with bf16=True) the op computes in its own precision:
    short rows take the support-list path, whose sparse CSR product has no bf16 kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, 64, generator=g).requires_grad_() for h in (9, 3, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sparse_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), method="entmax", alpha=1.5)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = sparse_attention(*(t.to(torch.bfloat16).float() for t in (q, k, v)), method="entmax", alpha=1.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(gr).all() for gr in grads)
