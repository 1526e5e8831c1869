"""Triton kernels of α-entmax attention (forward and backward), behind ``torch.ops.hf_sparse_attn.entmax_fwd/bwd``.

Math (see ``hf_sparse_attn.methods.entmax``): scaled logits ``s = (α-1)·z`` (z = softcap(scale·q·k)), probabilities
``p = [s - τ]_+^{1/(α-1)}`` normalised by their row sum, ``τ`` the root of ``Σ [s - τ]_+^e = 1``.

Forward, one program per (query block, query head), or with ``pack`` per (query block, KV group) with the group's
heads stacked as rows (each K/V tile loaded once for them); K/V read in place (GQA). Two dense
passes over the visible key tiles, both QKᵀ only (no V), then output passes over the candidate tiles only:
  A. row max and a histogram of the scores in ``[max - 1, max]`` (τ lies there): 16 bins of width 1/15 on an absolute
     grid, 4-bit counters packed in one uint64 per (row, key lane) — one add per score — shifted down by whole bins
     when the running max grows. From the counts, Newton on the histogram alone (no K loads) gives a lower bound τ_lo
     (every score moved down to its bin's lower edge) and a start point (scores at the bin centres); τ ≤ τ_lo + 1/15.
  B. one Halley (α = 1.5; Newton otherwise) update from the start point, clipped to the bracket, and the candidate
     tiles: those with a score above τ_lo (a superset of the non-zero tiles for any τ ≥ τ_lo).
  C. output ``acc += p·V`` over the candidate tiles, skipping those without an entry above τ; the pass also yields
     ``Σp`` exactly, and a row with ``|Σp - 1| > tol`` gets a Newton update and the pass repeats (rarely: see
     :data:`TOL`). The last pass writes the tile mask (2 non-zero, 1 visible but zero).
  Stores out (normalised), τ (absolute scaled units), the row sums, the support sizes and per block the number of
  τ updates and the final |Σp - 1| (``diag``). The old structure (row max, then Newton passes over every key tile
  until no row moved) made 1 + 6-7 dense passes on the same inputs.
Backward (``dz = u ⊙ (dP - δ)``, ``u = [s - τ]_+^{(2-α)/(α-1)}``, ``δ = Σ u·dP / Σ u``), p recomputed from τ:
  * dQ kernel per query block: a δ pass, then dQ (and the per-row α-gradient terms) — stores δ;
  * dK/dV kernel per (key block, KV head): loops over the query heads of the group and the query blocks that see
    the key block (no atomics: deterministic).
Sequence lengths, offsets, window and α are runtime values (no recompilation per length); head_dim, block sizes,
α mode (1.5 / 2 / general), softcap on/off and padding on/off are compile-time.
"""

from __future__ import annotations

import torch
import triton

from hf_sparse_attn.ops.entmax.cpu_tiles import TILE, tile_grid
from hf_sparse_attn.ops.entmax.triton_bwd import (
    _entmax_bwd_dkdv_kernel,
    _entmax_bwd_dq_kernel,
)
from hf_sparse_attn.ops.entmax.triton_fwd import _entmax_fwd_kernel

# num_warps of the 16-bit kernels at head_dim <= 128 (8 warps spill less; ``benchmarks/gpu_check_entmax.sh`` times
# both as its ``w8`` columns).
WARPS_16BIT = 4


def _blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the tile mask's 64×64 geometry (``ops.entmax.cpu_tiles.TILE``); 8 warps
    at head_dim 256 and in fp32, else :data:`WARPS_16BIT`."""
    return TILE, TILE, 8 if (head_dim >= 256 or dtype == torch.float32) else WARPS_16BIT


# |Σp - 1| every row must reach (fp32 sums) before the output is kept; rows above it take one more Newton update and
# output pass.
TOL = 1e-4
MAX_ITER = 30  # output passes at most (each after the first is one Newton update of the rows not yet within TOL)


# The forward's default program layout: per (query block, query head) (False) or per (query block, KV group) (True:
# K/V tiles loaded once per group at GROUP·64 rows of state per program). Both are tested against the reference;
# ``benchmarks/gpu_check_entmax.sh`` times both.
PACK_GQA = False


def forward(q, k, v, alpha, n_valid, first_valid, scale, softcap, window, mode, visits=None, tol: float = TOL,
            blocks=None, pack: bool | None = None):
    """Launch the forward kernel. Returns (out, τ, row sums, support sizes, tile mask, diag) like ``entmax_fwd``;
    diag = [τ updates after the histogram bracket (1 = the pass-B update only; each more is one more output pass)
    of the slowest query block, max |Σp - 1| before the final normalisation], computed on the device (no sync).
    ``visits`` (test only): a zeroed uint8 tensor shaped like the tile mask; the kernel sets 1 where its last output
    pass ran P·V. ``tol``: the |Σp - 1| a row must reach (:data:`TOL`). ``blocks`` (benchmarks): a list that receives
    the (programs, 2) tensor of per-program [τ updates, |Σp - 1|] behind ``diag``. ``pack``: one program per
    (query block, KV group) instead of per (query block, query head), so each K/V tile is loaded once for the
    group's heads (default :data:`PACK_GQA`; same results, see the tests)."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((b, hq, sq, dh), dtype=q.dtype, device=q.device)
    tau = torch.empty((b, hq, sq), dtype=ct, device=q.device)
    norm = torch.empty_like(tau)
    supp = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    nqt, nkt = tile_grid(sq, skv)
    tiles = torch.zeros((b, hq, nqt, nkt), dtype=torch.uint8, device=q.device)
    nv = n_valid.to(torch.float32).contiguous()
    fv = first_valid if first_valid is not None else tau  # dummy pointer when unused
    bm, bn, warps = _blocks(dh, q.dtype)
    hpp = hq // hkv if (PACK_GQA if pack is None else pack) else 1
    grid = (triton.cdiv(sq, bm), b * hq // hpp)
    per_block = torch.zeros((grid[0] * grid[1], 2), dtype=torch.float32, device=q.device)
    _entmax_fwd_kernel[grid](
        q, k, v, alpha.to(torch.float32).contiguous(), nv, fv, out, tau, norm, supp, tiles,
        visits if visits is not None else tiles, per_block,
        *q.stride(), *k.stride(), *v.stride(), nv.stride(0) if nv.shape[0] > 1 else 0,
        sq, skv, skv - sq, int(window), hq // hkv, hq, hpp, float(scale), float(softcap or 1.0), float(tol), MAX_ITER,
        nqt, nkt,
        HEAD_DIM=dh, BLOCK_M=bm, BLOCK_N=bn, GROUP=triton.next_power_of_2(hpp), MODE=int(mode),
        HAS_SOFTCAP=bool(softcap), HAS_FV=first_valid is not None, FP32=q.dtype == torch.float32,
        COUNT=visits is not None, num_warps=warps,
    )
    if blocks is not None:
        blocks.append(per_block)
    return out, tau, norm, supp, tiles, per_block.amax(0)


def backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, scale, softcap, window, mode, need_dalpha,
             visits_dq=None, visits_dkdv=None):
    """Launch the backward kernels over the non-zero tiles of ``tiles``. Returns (dq, dk, dv, dalpha (Hq,)) like
    ``entmax_bwd``. ``visits_dq`` / ``visits_dkdv`` (test only): zeroed uint8 tensors shaped like ``tiles``; each
    kernel sets 1 on the tiles it computed."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    do = dout.contiguous()
    tau = tau.contiguous()
    norm = norm.contiguous()
    tiles = tiles.contiguous()
    nqt, nkt = tiles.shape[-2], tiles.shape[-1]
    dq = torch.empty((b, hq, sq, dh), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, skv, dh), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, hkv, skv, dh), dtype=v.dtype, device=q.device)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    darow = torch.zeros((b, hq, sq), dtype=torch.float32, device=q.device)
    fv = first_valid if first_valid is not None else delta
    alpha32 = alpha.to(torch.float32).contiguous()
    bm, bn, warps = _blocks(dh, q.dtype)
    common = dict(HEAD_DIM=dh, BLOCK_M=bm, BLOCK_N=bn, MODE=int(mode), HAS_SOFTCAP=bool(softcap),
                  HAS_FV=first_valid is not None, FP32=q.dtype == torch.float32, num_warps=warps)
    strides = (*q.stride(), *k.stride(), *v.stride())
    _entmax_bwd_dq_kernel[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, alpha32, tau, norm, fv, tiles, visits_dq if visits_dq is not None else tiles, dq, delta, darow,
        *strides, sq, skv, skv - sq, int(window), hq // hkv, hq, float(scale), float(softcap or 1.0), nqt, nkt,
        NEED_DALPHA=bool(need_dalpha), COUNT=visits_dq is not None, **common,
    )
    _entmax_bwd_dkdv_kernel[(triton.cdiv(skv, bn), b * hkv)](
        q, k, v, do, alpha32, tau, norm, fv, tiles, visits_dkdv if visits_dkdv is not None else tiles, delta, dk, dv,
        *strides, sq, skv, skv - sq, int(window), hq // hkv, hq, hkv, float(scale), float(softcap or 1.0), nqt, nkt,
        COUNT=visits_dkdv is not None, **common,
    )
    dalpha = darow.sum(dim=(0, 2)).to(alpha.dtype) if need_dalpha else torch.zeros_like(alpha, dtype=ct)
    return dq, dk, dv, dalpha
