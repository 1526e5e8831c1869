"""Compile the GPU kernels for Hopper (sm_90a) on a machine without a GPU, exactly as a launch would, and count what
a tile costs them: registers and spills (ptxas ``-v``) and the SASS instructions of every loop, by path and by
source line (``nvdisasm``).

A launch ``kernel[grid](*args, **constexprs)`` inside :func:`compile_launches` is compiled instead of run, with the
argument specialization of Triton's own launcher (integers equal to 1 become constants, pointers and integers
divisible by 16 are marked so): without it every load of a ``(rows, head_dim)`` tile is a scalar 2-byte load with
its own 64-bit address, and ptxas reports spills that a real launch does not have.

What a loop costs per iteration is the instructions the warps issue on its path: a Hopper SM issues one warp
instruction per clock per scheduler (4), and a 64×64×128 bf16 product takes ≈ 256 clocks of one SM's tensor cores
(989 TFLOP/s over 132 SMs at 1.83 GHz), so a 4-warp loop of ``I`` instructions and ``G`` 64×64×16 products
(``HGMMA``) is issue-bound when ``I`` exceeds ≈ 32·G (both per CTA; several CTAs per SM share both). Branches
inside a loop body (the diagonal tile's mask, a pass's skip of a zero tile) make several paths; the report gives
the shortest and longest path and the instructions each branch skips, with the source lines they come from.

Usage (any machine with Triton; ``nvdisasm`` from the ``nvidia-cuda-nvdisasm`` wheel or ``$NVDISASM``)::

    python benchmarks/count_sass.py                      # entmax forward (α 1.5) and bfla forward, bf16, d 128
    python benchmarks/count_sass.py --kernels entmax_fwd,entmax_bwd --warps 4,8 --out sass.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import torch


@dataclass
class Launch:
    """One compiled launch: the kernel's name, Triton's ``CompiledKernel`` and the launch's ``num_warps``."""

    name: str
    kernel: object
    num_warps: int


@contextmanager
def compile_launches(capability: int = 90):
    """Inside, every Triton launch compiles for ``cuda:capability`` (nothing runs); yields the list of
    :class:`Launch` es, in launch order. The launch's own specialization (Triton's binder) is used."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import KernelInterface, create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        def launch(*args, **kwargs):
            binder = create_function_from_signature(self.signature, self.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
            kernel = compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
            launches.append(Launch(self.__name__, kernel, int(kernel.metadata.num_warps)))

        return launch

    KernelInterface.__getitem__ = getitem
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def ptxas_usage(ptx: str) -> dict | None:
    """``{"registers", "spill_stores", "spill_loads"}`` per thread from Triton's ptxas (``-v``, sm_90a), or None
    where this Triton has no ptxas helper."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - a Triton without the helper: no report
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    stores = re.findall(r"(\d+) bytes spill stores", r.stderr)
    loads = re.findall(r"(\d+) bytes spill loads", r.stderr)
    return {"registers": max(map(int, regs), default=0), "spill_stores": max(map(int, stores), default=0),
            "spill_loads": max(map(int, loads), default=0)}


# ---------------------------------------------------------------------------------------------------------- SASS


def nvdisasm_path() -> str | None:
    """``$NVDISASM``, ``nvdisasm`` on the PATH, or the one of an installed ``nvidia-cuda-nvdisasm`` wheel."""
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")):
            return path
    return None


@dataclass
class Sass:
    """A kernel's SASS: ``ins`` = (address, instruction, source line or 0), ``labels`` = label -> address."""

    ins: list[tuple[int, str, int]]
    labels: dict[str, int]
    index: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        self.index = {a: i for i, (a, _, _) in enumerate(self.ins)}


def disassemble(cubin: bytes, source: str) -> Sass:
    """Disassemble ``cubin`` with source lines of the file whose path ends with ``source``."""
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    ins, labels, pending, line = [], {}, [], 0
    for raw in text.splitlines():
        m = re.match(r'\s*//## File "(.*)", line (\d+)', raw)
        if m:
            line = int(m.group(2)) if m.group(1).endswith(source) else 0
            continue
        m = re.match(r"^(\.L_x_\d+):", raw.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", raw)
        if m:
            addr = int(m.group(1), 16)
            labels.update({name: addr for name in pending})
            pending = []
            ins.append((addr, m.group(2), line))
    return Sass(ins, labels)


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


_KINDS = {
    "tensor": ("HGMMA", "HMMA", "WARPGROUP"),
    "mufu": ("MUFU",),
    "fp": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FRND", "F2I", "I2F", "F2F", "F2FP", "FSET", "FCHK"),
    "spill": ("LDL", "STL"),
    "mem": ("LDG", "STG", "LDS", "STS", "LDGSTS", "LDSM", "STSM", "ATOMG", "RED", "LDGDEPBAR", "SYNCS", "UTMALDG"),
    "control": ("BRA", "BSSY", "BSYNC", "BAR", "EXIT", "WARPSYNC", "DEPBAR", "YIELD", "NOP", "BREAK"),
}


def _kind(op: str) -> str:
    base = op.split(".")[0]
    for kind, names in _KINDS.items():
        if base in names:
            return kind
    return "uniform" if base.startswith("U") or base in ("S2UR", "R2UR") else "int"


def _branch(sass: Sass, i: int) -> tuple[int | None, bool]:
    """(target address or None, conditional) of instruction ``i``."""
    text = sass.ins[i][1]
    m = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+\s*,\s*)?`?\(?(\.L_x_\d+)", text)
    if not m:
        return None, False
    return sass.labels.get(m.group(1)), text.startswith("@") or "BRA.DIV" in text


def _paths(sass: Sass, s: int, e: int) -> tuple[list[int], int]:
    """The shortest path (instruction indices) from ``s`` to the loop latch ``e`` and the longest path's length;
    branches out of the loop and inner back edges are not taken (an inner loop's body counts once)."""
    lo, hi, step = [0] * (e + 2), [0] * (e + 2), [0] * (e + 2)
    for i in range(e, s - 1, -1):
        if i == e:
            lo[i] = hi[i] = 1
            continue
        target, cond = _branch(sass, i)
        nexts = [i + 1]
        if target is not None and sass.index.get(target, -1) > i and sass.index[target] <= e:
            nexts = [sass.index[target]] + ([i + 1] if cond else [])
        step[i] = min(nexts, key=lambda j: lo[j])
        lo[i] = 1 + lo[step[i]]
        hi[i] = 1 + max(hi[j] for j in nexts)
    path, i = [], s
    while i != e:
        path.append(i)
        i = step[i]
    return path + [e], hi[s]


def loops(sass: Sass) -> list[dict]:
    """Every loop (a backward branch): its latch's source line, body size, the shortest / longest path (and the
    shortest path's instructions by source line), instructions by kind, each forward branch inside and what it
    skips."""
    out = []
    for e, (addr, _, _) in enumerate(sass.ins):
        target, _ = _branch(sass, e)
        if target is None or target > addr or target not in sass.index:
            continue
        s = sass.index[target]
        body = sass.ins[s : e + 1]
        lines = [ln for _, _, ln in body if ln]
        kinds = Counter(_kind(_opcode(t)) for _, t, _ in body)
        hgmma = sum(_opcode(t).startswith("HGMMA") for _, t, _ in body)
        path, longest = _paths(sass, s, e)
        by_line = Counter(sass.ins[i][2] for i in path)
        skips = []
        for i in range(s, e):
            tgt, cond = _branch(sass, i)
            if tgt is not None and cond and tgt > sass.ins[i][0] and sass.index.get(tgt, e + 1) <= e:
                j = sass.index[tgt]
                region = [ln for _, _, ln in sass.ins[i + 1 : j] if ln]
                skips.append({"at_line": sass.ins[i][2], "skips": j - i - 1,
                              "lines": [min(region), max(region)] if region else []})
        out.append({"latch_line": sass.ins[e][2], "lines": [min(lines), max(lines)] if lines else [],
                    "body": e - s + 1, "shortest": len(path),
                    "longest": longest, "hgmma": hgmma, "kinds": dict(sorted(kinds.items())), "branches": skips,
                    "shortest_by_line": dict(by_line.most_common())})
    return out


# ------------------------------------------------------------------------------------------- the kernels' launches


def launch_entmax(mode: int, dtype: torch.dtype, head_dim: int = 128, backward: bool = True,
                  softcap: float | None = 30.0) -> None:
    """The entmax forward (and dQ, dK/dV) launches of α ``mode`` (0 general, 1: 1.5, 2: 2) at GQA 4."""
    from hf_sparse_attn.ops.entmax import triton as KT

    b, hq, hkv, s, d = 1, 8, 2, 256, head_dim
    q, k, v = (torch.zeros(b, h, s, d, dtype=dtype) for h in (hq, hkv, hkv))
    alpha = torch.full((hq,), 1.5)
    n_valid = torch.arange(1, s + 1, dtype=torch.float32)[None]
    out, tau, norm, _, tiles, _ = KT.forward(q, k, v, alpha, n_valid, None, d**-0.5, softcap, 0, mode)
    if backward:
        KT.backward(out, q, k, v, alpha, tau, norm, tiles, None, d**-0.5, softcap, 0, mode, True)


def launch_bfla(head_dim: int, dtype: torch.dtype, backward: bool = True) -> None:
    """bfla's forward (and dQ, dK/dV) launches with the tiles a GPU run picks (block 128, GQA 4)."""
    from hf_sparse_attn.ops.block_sparse import triton_bwd as bfla_bwd
    from hf_sparse_attn.ops.block_sparse import triton_fwd as bfla_fwd

    b, hq, hkv, s, bs = 1, 8, 2, 256, 128
    q, k, v = (torch.zeros(b, h, s, head_dim, dtype=dtype) for h in (hq, hkv, hkv))
    nq = s // bs
    counts = torch.full((b, hkv, nq), 1, dtype=torch.int32)
    ids = torch.zeros((b, hkv, nq, nq), dtype=torch.int32)
    bm, bn, hpt = bfla_fwd.fwd_tiles(hq // hkv, bs, head_dim, True)
    o, lse = bfla_fwd._launch_fwd(q, k, v, counts, ids, head_dim**-0.5, 0.0, 0, bs, bm, bn, hpt)
    if backward:  # with the tile sizes of a compiled (not interpreted) run
        with mock.patch.object(bfla_bwd, "compiled_on_cuda", lambda q: True):
            bfla_bwd.triton_bwd(o, q, k, v, o, lse.float(), counts, ids, head_dim**-0.5, 0.0, 0, bs)


def launch_plan(nk: int = 16, key_chunks: tuple[int, ...] = (0, 2)) -> None:
    """bfla's two plan launches with every option a GPU run can switch on (softcap, window, left padding, per-head
    ``keep_mass``); GQA 4, head_dim 128, bf16; the estimate whole and split over its key range. ``nk``: key blocks
    of the select tile."""
    from hf_sparse_attn.methods.bfla import BflaConfig
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_estimate, plan_select

    b, hq, hkv, s, d, bs = 2, 8, 2, 2048, 128, 128
    q, k = (torch.zeros(b, h, s, d, dtype=torch.bfloat16) for h in (hq, hkv))
    fv = torch.tensor([0, 5])
    for key_chunk in key_chunks:
        plan_estimate(q, k, scale=d**-0.5, softcap=30.0, sliding_window=512, block_size=bs, rows_per_block=8,
                      first_valid=fv, key_chunk=key_chunk)
    n = nk * bs
    plan_select(torch.zeros(b, hq, nk, nk), torch.zeros(b, hq, nk), batch=b, kv_heads=hkv, sq=n, skv=n,
                sliding_window=512, config=BflaConfig(keep_mass=(0.9,) * hq), first_valid=fv)


GROUPS = {  # name -> (launch, source file of its kernels)
    "entmax_fwd": (lambda: launch_entmax(1, torch.bfloat16, backward=False, softcap=None), "entmax_triton.py"),
    "entmax_bwd": (lambda: launch_entmax(1, torch.bfloat16, softcap=None), "entmax_triton.py"),
    "bfla_fwd": (lambda: launch_bfla(128, torch.bfloat16, backward=False), "bfla_fwd.py"),
    "bfla_bwd": (lambda: launch_bfla(128, torch.bfloat16), "bfla_bwd.py"),
    "plan": (lambda: launch_plan(16, (0,)), "bfla_plan.py"),
}


def report(groups: list[str], warps: list[int], with_sass: bool = True) -> list[dict]:
    """Compile each group's launches (entmax at each of ``warps``) and count them."""
    from hf_sparse_attn.ops.entmax import triton as KT

    rows, seen = [], set()
    for group in groups:
        launch, source = GROUPS[group]
        for w in warps if group.startswith("entmax") else [None]:
            with compile_launches() as launches, (mock.patch.object(KT, "WARPS_16BIT", w) if w else nullcontext()):
                launch()
            for lc in launches:
                key = (lc.name, lc.num_warps)
                if key in seen:
                    continue
                seen.add(key)
                row = {"kernel": lc.name, "num_warps": lc.num_warps, "shared": int(lc.kernel.metadata.shared),
                       **(ptxas_usage(lc.kernel.asm["ptx"]) or {})}
                if with_sass:
                    row["loops"] = loops(disassemble(lc.kernel.asm["cubin"], source))
                rows.append(row)
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        print(f"\n{r['kernel']}  warps {r['num_warps']}  registers {r.get('registers')}  spill stores "
              f"{r.get('spill_stores')} B  shared {r['shared']} B")
        for lp in r.get("loops", []):
            print(f"  loop at line {lp['latch_line']} (lines {lp['lines']}): body {lp['body']}, "
                  f"paths {lp['shortest']}-{lp['longest']}, "
                  f"HGMMA {lp['hgmma']}, " + ", ".join(f"{k} {v}" for k, v in lp["kinds"].items()))
            top = ", ".join(f"{ln}: {n}" for ln, n in list(lp["shortest_by_line"].items())[:12])
            print(f"      shortest path by source line: {top}")
            for br in lp["branches"]:
                print(f"      branch at line {br['at_line']}: skips {br['skips']} (lines {br['lines']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="entmax_fwd,bfla_fwd", help=f"comma list of {sorted(GROUPS)}")
    p.add_argument("--warps", default="4", help="entmax num_warps to compile (comma list)")
    p.add_argument("--no-sass", action="store_true", help="registers and spills only (no nvdisasm needed)")
    p.add_argument("--out", default=None, help="write the report as JSON")
    a = p.parse_args()
    groups = [g for g in a.kernels.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        p.error(f"--kernels: {bad} not allowed; allowed: {sorted(GROUPS)}")
    rows = report(groups, [int(w) for w in a.warps.split(",")], with_sass=not a.no_sass)
    _print(rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
