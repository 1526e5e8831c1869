"""Triton α-entmax kernels vs the blockwise PyTorch path.

On CPU the kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before triton is
imported, so the rest of the session is unaffected). The interpreter cannot ``tl.dot`` bfloat16 (DESIGN §5): fp32
and fp16 are tested there, bf16 on a GPU (``test_cuda_*``, skipped without one).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hf_sparse_attn.kernels import entmax_triton as T
    from hf_sparse_attn.masks import LeftPadding
    from hf_sparse_attn.methods import entmax as E

    def run(alpha, hq, hkv, sq, skv, d, softcap, window, fv, dtype):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, s, d, generator=g).to(dtype) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query, as HF passes it
        a = torch.tensor(alpha, dtype=torch.float32).reshape(-1).expand(hq).contiguous()
        mode = 0 if isinstance(alpha, list) else E._alpha_mode(alpha)
        first = torch.tensor(fv) if fv is not None else None
        mask = LeftPadding(first, sq, skv) if fv is not None else None
        nv = E.key_counts(mask, 2, sq, skv, causal=True, sliding_window=window or None, device="cpu")
        scale = d ** -0.5
        out, tau, norm, supp = T.forward(q, k, v, a, nv, first, scale, softcap, window, mode)
        f32 = [t.float() for t in (q, k, v)]
        ref = E.entmax_fwd(*f32, a, nv, first, None, scale, softcap, window, True, mode, True)
        do = torch.randn(out.shape, generator=g).to(dtype)
        grads = T.backward(do, q, k, v, a, tau, norm, first, scale, softcap, window, mode, True)
        rgrads = E.entmax_bwd(do.float(), *f32, a, ref[1], ref[2], first, None, scale, softcap, window, True, mode,
                              True)
        live = nv.expand(2, sq)[:, None, :].expand(2, hq, sq) > 0

        def rel(x, y):
            return float((x.float() - y).abs().max() / y.abs().max().clamp(min=1.0))

        return {
            "out": rel(out, ref[0]),
            "tau": float((tau - ref[1])[live].abs().max()),
            "support_equal": bool(torch.equal(supp, ref[3])),
            "dq": rel(grads[0], rgrads[0]), "dk": rel(grads[1], rgrads[1]), "dv": rel(grads[2], rgrads[2]),
            "dalpha": rel(grads[3], rgrads[3]),
            "finite": bool(all(torch.isfinite(t).all() for t in (out, *grads))),
        }

    cases = json.loads(sys.argv[1])
    results = []
    for c in cases:
        c = dict(c)
        c["dtype"] = getattr(torch, c["dtype"])
        results.append(run(**c))
    print("RESULTS" + json.dumps(results))
    """
)


def _cases():
    cases = []
    for alpha in (1.25, 1.5, 2.0):
        for hq, hkv in ((2, 2), (4, 1)):
            for softcap in (0.0, 3.0):
                a = [1.25, 1.4, 1.7, 1.9] if (alpha == 1.25 and hq == 4) else alpha  # per-head α
                cases.append(dict(alpha=a, hq=hq, hkv=hkv, sq=37, skv=45, d=64, softcap=softcap, window=0,
                                  fv=None, dtype="float32"))
    cases.append(dict(alpha=1.5, hq=4, hkv=2, sq=33, skv=33, d=64, softcap=0.0, window=7, fv=[0, 5],
                      dtype="float32"))
    cases.append(dict(alpha=2.0, hq=4, hkv=2, sq=1, skv=50, d=64, softcap=2.0, window=9, fv=None, dtype="float32"))
    cases.append(dict(alpha=1.5, hq=2, hkv=1, sq=19, skv=19, d=128, softcap=0.0, window=0, fv=None,
                      dtype="float32"))
    for alpha in (1.5, 2.0):
        cases.append(dict(alpha=alpha, hq=4, hkv=1, sq=37, skv=45, d=64, softcap=3.0, window=0, fv=None,
                          dtype="float16"))
    return cases


@pytest.fixture(scope="module")
def interpreter_results():
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the kernels are tested directly (test_cuda_*)")
    cases = _cases()
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")][-1]
    return list(zip(cases, json.loads(line[len("RESULTS"):]), strict=True))


@pytest.mark.interpreter
def test_interpreter_kernels_match_blockwise_path(interpreter_results):
    failures = []
    for case, r in interpreter_results:
        half = case["dtype"] != "float32"
        tol = 2e-2 if half else 1e-4
        gtol = 5e-2 if half else 1e-4
        ok = (
            r["finite"]
            and r["out"] <= tol
            and (half or r["tau"] <= 1e-5)
            and (half or r["support_equal"])
            and max(r["dq"], r["dk"], r["dv"]) <= gtol
            and r["dalpha"] <= (2e-1 if half else 1e-3)
        )
        if not ok:
            failures.append((case, r))
    assert not failures, failures


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
def test_cuda_custom_op_matches_cpu_path(dtype, alpha):
    from hf_sparse_attn.masks import LeftPadding
    from hf_sparse_attn.methods.entmax import entmax_attention

    g = torch.Generator().manual_seed(0)
    for hq, hkv, sq, skv, d, softcap, window, pad in (
        (8, 2, 300, 300, 128, None, None, None),
        (4, 4, 77, 301, 64, 30.0, None, None),
        (8, 2, 1, 513, 128, None, 100, None),
        (4, 2, 129, 129, 256, None, None, [0, 17]),
    ):
        q, k, v = (torch.randn(2, h, s, d, generator=g) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
        mask = LeftPadding(torch.tensor(pad), sq, skv) if pad else None
        res = []
        for dev in ("cpu", "cuda"):
            qd, kd, vd = (t.to(dev, dtype).requires_grad_(True) for t in (q, k, v))
            m = LeftPadding(mask.first_valid.to(dev), sq, skv) if mask is not None else None
            out = entmax_attention(qd, kd, vd, m, alpha=alpha, softcap=softcap, sliding_window=window)
            out.float().square().sum().backward()
            res.append([t.detach().float().cpu() for t in (out, qd.grad, kd.grad, vd.grad)])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for a, b in zip(res[0], res[1], strict=True):
            assert torch.isfinite(b).all()
            assert (a - b).abs().max() / b.abs().max().clamp(min=1) <= tol
