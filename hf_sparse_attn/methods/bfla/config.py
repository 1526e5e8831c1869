"""``BflaConfig``: bfla's options, their validation and the measurements behind the defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hf_sparse_attn.core.checks import check_choice, check_range
from hf_sparse_attn.methods.base import MethodConfig

ESTIMATORS = ("rows", "pooled", "antidiag")
BACKENDS = ("auto", "torch", "triton", "flex")
HEAD_LISTS = ("auto", "group", "head")
_BIG = 1 << 30


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer in [{low}, {high}]")
    check_range(name, value, low, high)


@dataclass
class BflaConfig(MethodConfig):
    """Configuration of ``bfla``. Defaults measured with ``benchmarks/bench_bfla_cpu.py`` on Q/K/V captured from
    SmolLM2-135M-Instruct at 8k tokens (all 30 layers; 9 query / 3 KV heads, head_dim 64):

    * ``estimator="rows"``, ``rows_per_block=8``: the exact softmax of 8 strided query rows per query block
      against all causal keys, summed per key block (block log-sum-exps), i.e. an unbiased sample of the true
      block mass, so ``keep_mass`` means what it says. Against the oracle (exact block masses, smallest set
      reaching 95 %, union over the GQA group) it gives the oracle's density (0.373 vs 0.381 mean over layers)
      while keeping 97 % of the true mass (the oracle keeps ≥ 95 % per query head; the union adds the rest).
      ``pooled`` (mean query of the block) under-selects (density 0.27, only 93 % of the mass kept, 77 % in the
      worst layer); ``antidiag`` (XAttention-style, stride 16) keeps only 80 % of the mass on average. 4 rows
      match 8 rows within 0.01 density in most layers, but on the two ``niah_multivalue`` 8k samples the 4-row
      default lost (dense 25 / 50, 4 rows 0 / 0 at density 0.45 / 0.44) 8 rows answer (25 / 25 at 0.46 / 0.45),
      where ``keep_mass=0.98`` at 4 rows scored 0 / 25 at a higher density (0.56 / 0.54): the sampling noise of 4
      rows more than the mass budget drops the retrieval heads' needle blocks (2026-12-02). 8 rows cost more plan
      time: per layer at 8k (2 threads, idle, ``benchmarks/bfla_layer_times.py``) the plan takes 68–74 ms with 8
      rows vs 38–49 ms with 4 (≈ 17 % vs ≈ 10 % of dense SDPA); the whole-op bench showed 1.18× vs 1.20× dense. 2
      rows lose mass in sharp layers (93 %).
    * ``keep_mass=0.95``: calibrated, see above.
    * ``block_size=128``: the estimate, the lists and the kernel tile share one grid; 128 amortizes the per-block
      work of the CPU path (flash calls over gathered K/V blocks) and matches the GPU kernel's tiles.
    * ``sink=1``, ``local=1``: the first key block and the key blocks overlapping the query block's positions plus
      one block back are always kept (attention sinks and local context; ≈ 3 blocks per row).
    * ``dense_last_blocks=1``: the last query block produces the next token; it is computed densely.
    * ``flat_entropy=0.8``: measured per head, the mean normalized entropy of the estimated block distribution
      tracks the density the head needs: heads above 0.8 (e.g. most of layer 0) need 75–90 % of the blocks, where
      the sparse path is slower than dense and saves nothing, so the whole KV head runs densely (exact).
    * ``min_seq_len=None``: the device's default, :data:`MIN_SEQ_LEN` — 6144 on CPU, 32768 on CUDA; an int applies
      on every device. CUDA (H200, bf16, 2026-12-04, ``benchmarks/gpu_check.sh``, against what the dense path
      runs: SDPA with its own backend choice, 1.65–1.7× faster than SDPA's flash backend there): SmolLM2 Q/K
      (9/3 heads, d 64) at the default config, plan + kernel ÷ dense speed 0.14–0.29× at 4k, 0.39–0.42× at 8k,
      0.69–0.71× at 16k (density 0.28–0.31; the plan alone 0.40 ms = 56 % of dense); 32/8 heads, d 128: the
      plan is 36 % / 26 % / 18 % of dense at 8k / 16k / 32k, and plan + kernel at density 0.32 is 1.09× / 1.29×
      dense at 16k / 32k (8k at 0.39: 0.92×). Below 32k the gain is too thin or negative, so the dense path runs.
      CPU: where the whole prefill starts to gain. SmolLM2 end-to-end prefill, bfla ÷ dense speed at
      2 threads on an idle 2-core CPU (``hf-sparse-attn bench --no-op``, prose / random tokens, 2026-12-02): 4k
      0.93× / 0.94×, 5k 0.94× / 0.93×, 6k 0.99× / 1.02×, 8k 1.14× / 1.10× — the plan (8 sample rows per block,
      ≈ 17 % of a layer's dense time) and the per-block work cost more than the skipped tiles save below ≈ 6k, so
      shorter prompts run the exact dense path (DESIGN: "default 4096–8192, measured"). It was 3072 until then
      (1-thread attention-op figures: 1.70× at 4k, 1.98× at 8k); RULER at 4k with ``min_seq_len=3072``:
      README. Set it lower to sparsify shorter prompts (the tests do).

    * ``profile``: a JSON file written by ``hf-sparse-attn calibrate`` (:mod:`.profile`) with a ``keep_mass`` per layer
      and KV head measured for one model; read when a layer is patched (another model's profile, a missing or
      malformed file: a clear error). Layers the profile does not list keep ``keep_mass``.
      ``keep_mass`` may also be a tuple with one value per query head (what a profile gives each layer).

    * ``dense_density=None`` — the "never slower than dense" rule (inference; training keeps its sparse pattern):
      after the plan, a layer whose selected density (kept / causal tiles, rescues included, mean over batch rows
      and KV heads) exceeds it runs the exact dense path instead, reported by ``handle.stats()`` per layer as
      ``path="dense"`` with ``dense_reason``. ``None`` is the device's default, :data:`DENSE_DENSITY`: **0.7 on
      CPU, 0.55 on CUDA**; a number applies on every device; ``1.0`` disables the rule (the sparse kernel always
      runs; what the keep-all tests use).
      CPU (SmolLM2 Q/K/V, 2 threads, the worker-pool path, a loaded machine, ratios side by side): the sparse pass
      (plan included) breaks even with dense SDPA at a density of ≈ 0.6–0.75 at 4k and ≈ 0.6–0.7 at 8k (4k: 1.12×
      at 0.59, 0.96× at 0.69, 0.95× at 0.77, 0.83× at 1.0; 8k: 1.11× at 0.57, 1.19–1.32× at 0.46, 0.95× at 1.0).
      Flat layers (SmolLM2 layer 0) and Gemma 3 270M's full-attention layers (density 0.82–0.88 at 8k–16k) run
      dense; the plan (≈ 3–10 % of that layer's dense time) is the only cost left there. With the fused pass
      (measured 2026-12-04, idle, all 30 SmolLM2 layers at 8k: pass ≈ 1.07 × density × dense) SmolLM2's
      break-even lies near 0.9, but 0.8 measured no faster than 0.7 end to end (1.32× / 1.34× vs 1.35× / 1.33×
      dense, prose / random), and Gemma 3 270M's full layers (head dim 256, per-head lists) cost 1.2–1.4 ×
      density × dense (layers 5 / 11 / 17 at 8k: 701 / 719 / 405 ms against 688 / 682 / 710 ms at density 0.74 /
      0.75 / 0.47), so 0.8 would send its 0.74 layers to a sparse pass that is no faster than dense: 0.7 stays.
      The default was 0.6 until 2026-12-02; with it about six SmolLM2 layers per 8k prompt ran dense, and the
      attended density was 0.522 (12 RULER samples, ``benchmarks/density_rules.py``) against 0.486 at 0.7. The
      six-task grid at 0.7 (10 samples per task): 8k 35.7 vs dense 36.5 at attended density 0.486 (0.6: 35.7 at
      ≈ 0.52), 4k 48.2 vs 49.0 at 0.68 (0.6: 47.8).
      CUDA (H200, bf16, 32/8 heads, d 128, 2026-12-04; against SDPA's own backend choice, what the dense path
      runs): the kernel costs ≈ 0.9 × density × flash's time (keep-all 1.11× flash) and SDPA's default takes 0.6
      of flash's time, so after the plan the sparse kernel pays below a density of ≈ 0.55 at 32k (0.62 at 64k,
      0.64 at 128k); a flat layer at 32k would take (23.0 + 2.3) ms sparse against 13.0 ms dense. The rule reads
      the density on the host: one sync per layer (a layer at ≥ 32k takes milliseconds); inside CUDA-graph capture
      it is skipped (logged once) and the sparse kernel runs.
    * ``backend="auto"`` on CPU: the gather path on a worker pool (:mod:`.cpu_threads`), not ``flex``: measured
      at 8k (SmolLM2 layer 15, machine loaded), the compiled flex kernel alone took 2.5 s (2 threads) / 1.6 s
      (1 thread) where the pooled gather pass took ≈ 1.0 s, and flex's first compile took 254 s without an
      inductor cache on disk (15 s with it), which a single prefill would pay.

    * ``head_lists="auto"``: which heads share one list of kept tiles. ``"group"``: one list per KV head, the union of
      its query heads' selections (K/V tiles are gathered once for the whole group); ``"head"``: one list per query head
      (K/V repeated per query head; each head keeps only its own blocks, at the price of more, smaller gathers on CPU);
      ``"auto"``: ``"head"`` where one KV head serves every query head of the layer (Gemma 3 270M's 4 / 1), else
      ``"group"`` (SmolLM2, Llama, Qwen: unchanged). On a RULER 8k prompt Gemma 3 270M's full-attention layers keep
      1.00 / 1.00 / 0.72 of the tiles with the union (it takes every block any head wants) and 0.74 / 0.75 / 0.47 per
      query head (layers 5 / 11 / 17); at 16k 1.00 / 1.00 / 0.60 vs 0.64 / 0.70 / 0.36. RULER six-task grid (5
      samples per task, 2026-12-03): per-head lists score 48.8 vs dense 48.5 at 8k and 40.3 vs 36.7 at 16k, no sample
      below dense, full-layer density 0.70 / 0.54 attended. Full layers at 2 threads on an essay capture
      (``benchmarks/bfla_layer_times.py --model gemma3-270m``): 1.00× dense at 8k (0.92× with the union, every layer
      of which pays its plan and runs dense by the rule), 1.11× at 16k (1.05×). ``benchmarks/RESULTS.md``, 2026-12-03.

    Other keys: ``min_blocks`` (at least this many estimated-top key blocks per row), ``max_density`` (at most
    this fraction of a row's causal blocks by estimate; rescues come on top), ``antidiag_stride`` (stride of the
    ``antidiag`` estimator), ``backend`` ("auto": Triton on CUDA, the PyTorch gather path elsewhere; "flex":
    torch ``flex_attention`` compiled with a ``BlockMask`` built from the same lists — compiles once, on first use).
    Every rescue can be switched off: ``sink=0``, ``local=-1``, ``dense_last_blocks=0``, ``flat_entropy=1.0``.
    """

    block_size: int = 128
    keep_mass: float | tuple[float, ...] = 0.95
    min_blocks: int = 1
    max_density: float = 1.0
    sink: int = 1
    local: int = 1
    dense_last_blocks: int = 1
    flat_entropy: float = 0.8
    min_seq_len: int | None = None
    estimator: str = "rows"
    rows_per_block: int = 8
    antidiag_stride: int = 16
    backend: str = "auto"
    profile: str | None = None
    dense_density: float | None = None
    head_lists: str = "auto"

    def validate(self) -> None:
        check_choice("block_size", self.block_size, (16, 32, 64, 128, 256))
        if isinstance(self.keep_mass, (tuple, list)) and self.keep_mass:
            for x in self.keep_mass:
                check_range("keep_mass (per query head)", x, 0.0, 1.0, low_open=True)
            self.keep_mass = tuple(float(x) for x in self.keep_mass)
        else:
            check_range("keep_mass", self.keep_mass, 0.0, 1.0, low_open=True)
        _check_int("min_blocks", self.min_blocks, 0, _BIG)
        check_range("max_density", self.max_density, 0.0, 1.0, low_open=True)
        _check_int("sink", self.sink, 0, _BIG)
        _check_int("local", self.local, -1, _BIG)
        _check_int("dense_last_blocks", self.dense_last_blocks, 0, _BIG)
        check_range("flat_entropy", self.flat_entropy, 0.0, 1.0)
        if self.min_seq_len is not None:
            _check_int("min_seq_len", self.min_seq_len, 0, _BIG)
        check_choice("estimator", self.estimator, ESTIMATORS)
        _check_int("rows_per_block", self.rows_per_block, 1, self.block_size)
        check_choice("antidiag_stride", self.antidiag_stride, (1, 2, 4, 8, 16, 32, 64))
        if self.antidiag_stride > self.block_size:
            raise ValueError(
                f"antidiag_stride={self.antidiag_stride!r} is out of range; "
                f"allowed: at most block_size={self.block_size}"
            )
        check_choice("backend", self.backend, BACKENDS)
        if self.dense_density is not None:
            check_range("dense_density", self.dense_density, 0.0, 1.0)
        check_choice("head_lists", self.head_lists, HEAD_LISTS)
        if self.profile is not None and not isinstance(self.profile, (str, os.PathLike)):
            raise ValueError(f"profile={self.profile!r} is not allowed; allowed: None or the path of a profile JSON")


MIN_SEQ_LEN = {"cpu": 6144, "cuda": 32768}  # min_seq_len=None: the default of each device (see BflaConfig)
DENSE_DENSITY = {"cpu": 0.7, "cuda": 0.55}  # dense_density=None: the default of each device (see BflaConfig)


def _device_default(value, defaults: dict, device: torch.device):
    """``value``, or where it is None the ``defaults`` entry of ``device`` (devices not listed take the CPU one)."""
    return value if value is not None else defaults.get(device.type, defaults["cpu"])


def default_note(value, device: torch.device) -> str:
    """The suffix a ``dense_reason`` gets when the threshold it names is the device default (``value`` None)."""
    return "" if value is not None else f" (the {device.type} default)"


def min_seq_len(config: BflaConfig, device: torch.device) -> int:
    """The shortest prefill that runs the sparse path on ``device``: ``config.min_seq_len``, or the device's default
    (:data:`MIN_SEQ_LEN`)."""
    return _device_default(config.min_seq_len, MIN_SEQ_LEN, device)


def dense_density(config: BflaConfig, device: torch.device) -> float:
    """The selected density above which a planned layer runs the exact dense path on ``device``:
    ``config.dense_density``, or the device's default (:data:`DENSE_DENSITY`)."""
    return _device_default(config.dense_density, DENSE_DENSITY, device)


def lists_per_query_head(hq: int, hkv: int, config: BflaConfig) -> bool:
    """Whether the plan keeps one list per query head (``head_lists``) for a layer of ``hq`` query / ``hkv`` KV
    heads."""
    if hq == hkv or config.head_lists == "group":
        return False
    return config.head_lists == "head" or hkv == 1
