"""The plugin's paged K/V handling without vLLM: the plain layout (the CPU shadow cache, the entmax layers' cache and
vLLM's CUDA Triton cache), the row split, and a served layer's rows over a simulated paged cache against the
method on contiguous K/V (chunked prefill: a chunk's queries against every earlier key of their sequence).

The CUDA branch reads vLLM's Triton cache exactly this way; ``test_cuda_layout_bfla_triton_interpreted`` runs bfla's
Triton kernel on it under ``TRITON_INTERPRET=1`` (no CUDA build of vLLM is available to run it on a GPU)."""

import os
import subprocess
import sys

import pytest
import torch

from hf_sparse_attn.functional import sparse_attention
from hf_sparse_attn.methods.bfla import BflaConfig, make_plan
from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_fwd
from hf_sparse_attn.vllm.core import LayerRunner
from hf_sparse_attn.vllm.options import CONFIG_KEY, parse_options
from hf_sparse_attn.vllm.paged import (
    block_ids,
    gather_paged,
    kept_tile_batch,
    split_rows,
    subset_fields,
    write_paged,
)
from hf_sparse_attn.vllm.serve import ServingMixin

BS, HQ, HKV, D = 16, 4, 2, 32


def _paged_batch(lengths, num_blocks=40, seed=0, dtype=torch.float32):
    """Random K/V of sequences of ``lengths`` in a cache with shuffled blocks, written the way vLLM's Triton backend
    writes its cache (``kv_cache.transpose(1, 2).split(D, -1)``, then ``[block, offset] = key``), not with
    :func:`write_paged`. Returns (cache, block_table, [(k, v) contiguous (1, Hkv, L, D)])."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, HKV, BS, 2 * D, dtype=dtype)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # (nb, BS, Hkv, D) views
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max((n + BS - 1) // BS for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    seqs = []
    for i, n in enumerate(lengths):
        nblk = (n + BS - 1) // BS
        blocks = [perm.pop() for _ in range(nblk)]
        table[i, :nblk] = torch.tensor(blocks)
        k = torch.randn(n, HKV, D, generator=g, dtype=dtype)
        v = torch.randn(n, HKV, D, generator=g, dtype=dtype)
        for t in range(n):
            key_cache[blocks[t // BS], t % BS] = k[t]
            value_cache[blocks[t // BS], t % BS] = v[t]
        seqs.append((k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)))
    return cache, table, seqs


def test_gather_reads_the_triton_layout():
    cache, table, seqs = _paged_batch([1, 15, 16, 17, 70])
    for i, (k, v) in enumerate(seqs):
        n = k.shape[2]
        gk, gv = gather_paged(cache, block_ids(table[i], n, BS), n, D)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        if n > 20:  # a window's tail only (sliding-window layers gather from the first visible key)
            gk, gv = gather_paged(cache, block_ids(table[i], n, BS), n, D, start=19)
            assert torch.equal(gk, k[:, :, 19:]) and torch.equal(gv, v[:, :, 19:])


def test_write_matches_the_triton_layout_and_skips_padding():
    cache, table, seqs = _paged_batch([40, 23])
    mine = torch.zeros_like(cache)
    for i, (k, v) in enumerate(seqs):
        n = k.shape[2]
        pos = torch.arange(n)
        slots = table[i].long()[pos // BS] * BS + pos % BS
        # padding: a longer key tensor than slot_mapping, and -1 slots inside
        key = torch.cat((k[0].transpose(0, 1), torch.full((3, HKV, D), 7.0)))
        value = torch.cat((v[0].transpose(0, 1), torch.full((3, HKV, D), 7.0)))
        slots = torch.cat((slots, torch.tensor([-1, -1])))
        write_paged(mine, key, value, slots)
    assert torch.equal(mine, cache)


def test_gather_keys_only():
    cache, table, seqs = _paged_batch([70])
    k, v = seqs[0]
    gk, gv = gather_paged(cache, block_ids(table[0], 70, BS), 70, D, start=5, values=False)
    assert gv is None and torch.equal(gk, k[:, :, 5:])


def _paged_causal(query, cache, qsl, seq_lens, table, scale):
    """What vLLM's paged causal kernel computes (``cpu_attention_with_kv_cache``), over the plain layout: sequence
    ``i``'s queries ``qsl[i]:qsl[i+1]`` (``(T, H, D)``) sit at the last positions of its ``seq_lens[i]`` keys, read
    through ``table[i]``; query heads share KV heads in groups."""
    out = torch.zeros_like(query)
    for i in range(len(seq_lens)):
        n, q = int(seq_lens[i]), query[int(qsl[i]): int(qsl[i + 1])]
        k, v = gather_paged(cache, block_ids(table[i], n, cache.shape[2]), n, q.shape[-1])
        rep = q.shape[1] // k.shape[1]
        k, v = k[0].repeat_interleave(rep, 0), v[0].repeat_interleave(rep, 0)
        s = torch.einsum("qhd,hkd->hqk", q, k) * scale
        allowed = torch.arange(n)[None, :] <= torch.arange(n - q.shape[0], n)[:, None]
        out[int(qsl[i]): int(qsl[i + 1])] = torch.einsum("hqk,hkd->qhd", s.masked_fill(~allowed, -torch.inf)
                                                          .softmax(-1), v)
    return out


@pytest.mark.parametrize("tile,lists", [(16, "group"), (32, "group"), (16, "head")])
@pytest.mark.parametrize("seq_len,query_len", [(200, 200), (200, 73), (161, 48), (97, 5)])
def test_kept_tiles_as_paged_sequences_equal_the_plan(tile, lists, seq_len, query_len):
    """A bfla plan of a chunk (aligned or not with the tiles) as a batch of paged sequences, one per (list head, query
    block), through a kernel with vLLM's semantics: the attention of the plan's kept tiles exactly."""
    cache, table, seqs = _paged_batch([seq_len])
    k, v = seqs[0]
    q = torch.randn(1, HQ, query_len, D, generator=torch.Generator().manual_seed(2))
    cfg = BflaConfig(block_size=tile, keep_mass=0.5, flat_entropy=1.0, dense_last_blocks=0, head_lists=lists)
    k_lists = k.repeat_interleave(HQ // HKV, 1) if lists == "head" else k
    plan = make_plan(q, k, scale=D**-0.5, config=cfg)
    blocks = block_ids(table[0], seq_len, BS)
    batch = kept_tile_batch(plan, query_len, blocks, BS)
    assert batch is not None and batch.seq_lens.shape == plan.counts.shape[1:]
    per = HQ // plan.counts.shape[1]
    out = torch.empty(query_len, HQ, D)
    rows = q[0].transpose(0, 1)
    for h in range(plan.counts.shape[1]):
        kvh = h * per // (HQ // HKV)
        heads = slice(h * per, (h + 1) * per)
        out[:, heads] = _paged_causal(rows[:, heads], cache[:, kvh: kvh + 1], batch.query_start_loc,
                                      batch.seq_lens[h], batch.block_tables[h], D**-0.5)
    ref, _ = reference_sparse_fwd(q, k_lists, v.repeat_interleave(k_lists.shape[1] // HKV, 1), plan.counts,
                                  plan.ids, D**-0.5, 0.0, 0, tile)
    torch.testing.assert_close(out, ref[0].transpose(0, 1), atol=2e-5, rtol=1e-4)
    assert float(plan.counts.sum() / plan.valid.sum() / plan.counts.shape[1]) < 1.0 or query_len <= tile


def test_kept_tiles_need_the_query_blocks_own_tiles():
    """``local=-1``: a query block may drop the key tiles it overlaps; no paged batch then (bfla's own attention)."""
    cache, table, seqs = _paged_batch([200])
    k, _ = seqs[0]
    q = torch.randn(1, HQ, 200, D, generator=torch.Generator().manual_seed(2))
    plan = make_plan(q, k, scale=D**-0.5, config=BflaConfig(block_size=16, keep_mass=0.3, local=-1, min_blocks=0,
                                                           dense_last_blocks=0, flat_entropy=1.0, sink=0))
    assert kept_tile_batch(plan, 200, block_ids(table[0], 200, BS), BS) is None


def test_split_rows():
    qsl = torch.tensor([0, 1, 301, 302, 352])
    lens = torch.tensor([900, 300, 7000, 7050])  # decode, full prefill, decode, a chunk of 50 of a 7050 prompt
    s = split_rows(qsl, lens, "prefill")
    assert [r.index for r in s.ours] == [1, 3] and [r.index for r in s.theirs] == [0, 2]
    assert torch.equal(s.theirs_tokens, torch.tensor([0, 301]))
    s = split_rows(qsl, lens, "prefill_long", 6144)  # bfla: the total length decides, not the chunk's 50 queries
    assert [r.index for r in s.ours] == [3] and [r.index for r in s.theirs] == [0, 1, 2]
    s = split_rows(qsl, lens, "all")
    assert len(s.ours) == 4 and not s.theirs and s.theirs_tokens is None
    s = split_rows(torch.tensor([0, 1, 2, 40]), torch.tensor([5, 6, 40]), "prefill")
    assert s.theirs_tokens == slice(0, 2)  # contiguous rows: a view, no copy
    f = subset_fields(s.theirs, torch.tensor([5, 6, 40]), torch.arange(9).view(3, 3))
    assert f["query_start_loc"].tolist() == [0, 1, 2] and f["seq_lens"].tolist() == [5, 6]
    assert f["block_table"].tolist() == [[0, 1, 2], [3, 4, 5]] and f["num_actual_tokens"] == 2


class _Impl(ServingMixin):
    head_size = D

    def _store(self, runner, kv_cache):
        return kv_cache


def _serve(options, lengths, query_lens, window=None, softcap=None, method_kw=None):
    """Our rows of a batch over a simulated paged cache vs ``sparse_attention`` on each row's contiguous K/V."""
    cache, table, seqs = _paged_batch(lengths)
    rule = "all" if options.serves_decode else "prefill"
    qlens = torch.tensor(query_lens)
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.long)
    qsl[1:] = qlens.cumsum(0)
    split = split_rows(qsl, torch.tensor(lengths), rule)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(int(qsl[-1]), HQ, D, generator=g)
    output = torch.full_like(query, float("nan"))
    runner = LayerRunner(options, layer_name="model.layers.0.self_attn.attn", num_heads=HQ, num_kv_heads=HKV,
                         head_size=D, scale=D**-0.5, sliding_window=window, softcap=softcap,
                         device=torch.device("cpu"))
    assert runner.active
    _Impl()._ours(None, runner, query, cache, table, split, output)
    for row in split.ours:
        k, v = seqs[row.index]
        q = query[row.q_start: row.q_end].permute(1, 0, 2).unsqueeze(0)
        ref = sparse_attention(q, k, v, method=options.method, scale=D**-0.5, softcap=softcap, sliding_window=window,
                               **(method_kw or {}))
        torch.testing.assert_close(output[row.q_start: row.q_end], ref[0].transpose(0, 1), atol=2e-5, rtol=1e-4)
    return split, output, runner


def test_dense_rows_chunked_prefill():
    # a 37-query chunk of a 150-token sequence (keys 0..149), a whole 64-token prompt, a decode row (vLLM's)
    split, out, _ = _serve(parse_options({CONFIG_KEY: {"method": "dense"}}), [150, 64, 90], [37, 64, 1])
    assert [r.index for r in split.ours] == [0, 1] and torch.isnan(out[-1]).all()


def test_dense_rows_window_and_softcap():
    _serve(parse_options({CONFIG_KEY: {"method": "dense", "layers": "all"}}), [150, 64], [37, 64], window=20,
           softcap=5.0)


def test_bfla_rows_go_sparse_on_a_chunk():
    kw = {"block_size": 16, "dense_density": 1.0, "flat_entropy": 1.0, "keep_mass": 0.5, "min_seq_len": 0}
    opts = parse_options({CONFIG_KEY: {"method": "bfla", **kw}})
    split, _, runner = _serve(opts, [160, 200], [160, 70], method_kw=kw)
    st = runner.last_stats()  # the last row: the 70-query chunk of a 200-token sequence
    assert len(split.ours) == 2 and st["path"] == "sparse" and st["density"] < 1.0, st
    assert st["plan_seconds"] > 0 and st["attend_seconds"] > 0  # CPU: wall times of the plan and the attention


def test_stats_sum_the_attention_time_of_a_step_over_the_served_layers():
    from hf_sparse_attn.vllm.core import StatsRecorder
    from hf_sparse_attn.vllm.paged import Row

    rec = StatsRecorder()
    opts = parse_options({CONFIG_KEY: {"method": "bfla", "log_stats": False}})
    for i in (0, 3):
        rec.configure(opts, i)
    row = Row(index=0, q_start=0, q_end=100, seq_len=300)
    rec.layer(0, row, {"path": "sparse", "density": 0.5})
    rec.end_layer(0, 0.25)
    rec.layer(3, row, {"path": "dense", "density": 1.0})
    rec.end_layer(3, 0.5)  # the last served layer: the step is flushed
    rec.handed_over([row], "sequence length < min_seq_len 6144")  # a step vLLM's kernel serves
    rec.end_layer(0, 0.125)
    rec.end_layer(3, None)  # not measured (CUDA)
    first, second = rec.snapshot()["prefills"]
    assert first["attention_seconds"] == 0.75 and first["density"] == 0.75 and first["paths"] == {"sparse": 1,
                                                                                                   "dense": 1}
    assert second["attention_seconds"] == 0.125 and second["vllm"].startswith("sequence length")


def test_entmax_family_rows_prefill_and_decode():
    for method, kw in (("entmax", {"alpha": 1.5}), ("asentmax", {"beta_init": 0.3}), ("ssmax", {})):
        opts = parse_options({CONFIG_KEY: {"method": method, **kw}})
        split, out, _ = _serve(opts, [150, 64, 90], [37, 64, 1], window=40, method_kw=kw)
        assert len(split.ours) == 3 and not torch.isnan(out).any()


_INTERPRETED = r"""
import torch, sys
sys.path.insert(0, {here!r})
import test_paged as t
kw = {{"block_size": 16, "dense_density": 1.0, "flat_entropy": 1.0, "keep_mass": 0.5, "min_seq_len": 0,
      "backend": "triton"}}
opts = t.parse_options({{t.CONFIG_KEY: {{"method": "bfla", **kw}}}})
split, out, runner = t._serve(opts, [160, 200], [160, 70], method_kw=dict(kw, backend="torch"))
assert runner.last_stats()["path"] == "sparse", runner.last_stats()
print("ok", len(split.ours))
"""


@pytest.mark.interpreter
def test_cuda_layout_bfla_triton_interpreted():
    """bfla's Triton kernel (the CUDA path) over K/V gathered from a simulated vLLM Triton cache, under
    TRITON_INTERPRET=1, equals bfla's PyTorch path on contiguous K/V."""
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED.format(here=here)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0 and "ok 2" in done.stdout, done.stderr[-3000:]
