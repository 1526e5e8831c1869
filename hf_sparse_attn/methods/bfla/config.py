"""``BflaConfig``: bfla's options and their validation; the per-device defaults of the dispatch rules."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hf_sparse_attn.core.checks import check_choice, check_int, check_range
from hf_sparse_attn.methods.base import MethodConfig

ESTIMATORS = ("rows", "pooled", "antidiag")
BACKENDS = ("auto", "torch", "triton", "flex")
HEAD_LISTS = ("auto", "group", "head")
_BIG = 1 << 30


@dataclass
class BflaConfig(MethodConfig):
    """Options of ``bfla`` (validated on construction; a bad key or value raises ``ValueError`` naming it). Why
    each default is what it is: docs/methods/bfla.md; the figures behind them: docs/results.md.

    * ``block_size`` (128): edge of the tiles the estimate, the lists and the kernels share (16 ... 256).
    * ``keep_mass`` (0.95): estimated softmax mass each query block keeps, per query head; a float, or a tuple with
      one value per query head (what a calibrated profile gives a layer).
    * ``keep_mass_ref_len`` (None): a call with more keys than this keeps more mass: the dropped share
      ``1 - keep_mass`` shrinks as ``keep_mass_ref_len / Skv`` (:func:`keep_mass_at`); None: ``keep_mass`` at every
      length.
    * ``min_blocks`` (1) / ``max_density`` (1.0): at least / at most this many estimated-top key blocks (share of
      the row's causal blocks) per query block; rescues come on top.
    * Rescues, each switchable off: ``sink`` (1; leading key blocks, 0 = off), ``local`` (1; key blocks overlapping
      the query block plus this many back, -1 = off), ``dense_last_blocks`` (1; trailing query blocks computed
      densely, 0 = off), ``flat_entropy`` (0.8; a KV head whose estimated block distribution has a normalized
      entropy above this runs densely, 1.0 = off).
    * ``min_seq_len`` (None = the device default, :data:`MIN_SEQ_LEN`): shorter prefills run the exact dense path.
    * ``dense_density`` (None = the device default, :data:`DENSE_DENSITY`): after the plan, a layer whose selected
      density exceeds it runs the exact dense path (inference only; ``handle.stats()`` reports ``path="dense"`` and
      ``dense_reason``); 1.0 disables the rule. On CUDA the rule reads the density on the host (one sync per
      layer); inside CUDA-graph capture it is skipped (logged once).
    * ``estimator`` ("rows"): "rows" (exact softmax of ``rows_per_block`` (8) strided query rows per block, summed
      per key block), "pooled" (the block's mean query) or "antidiag" (anti-diagonal sampling with
      ``antidiag_stride``, 16).
    * ``backend`` ("auto"): Triton on CUDA, the PyTorch gather path on a CPU worker pool elsewhere; "torch",
      "triton", or "flex" (torch ``flex_attention`` with a ``BlockMask`` from the same lists; compiles on first use).
    * ``profile`` (None): path of a JSON written by ``hf-sparse-attn calibrate`` with a ``keep_mass`` per layer and
      KV head for one model (:mod:`.profile`); layers it does not list keep ``keep_mass``.
    * ``head_lists`` ("auto"): "group" = one list of kept tiles per KV head (the union of its query heads'
      selections), "head" = one per query head, "auto" = "head" where one KV head serves every query head of the
      layer, else "group".
    """

    block_size: int = 128
    keep_mass: float | tuple[float, ...] = 0.95
    keep_mass_ref_len: int | None = None
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
        if self.keep_mass_ref_len is not None:
            check_int("keep_mass_ref_len", self.keep_mass_ref_len, 1, _BIG)
        check_int("min_blocks", self.min_blocks, 0, _BIG)
        check_range("max_density", self.max_density, 0.0, 1.0, low_open=True)
        check_int("sink", self.sink, 0, _BIG)
        check_int("local", self.local, -1, _BIG)
        check_int("dense_last_blocks", self.dense_last_blocks, 0, _BIG)
        check_range("flat_entropy", self.flat_entropy, 0.0, 1.0)
        if self.min_seq_len is not None:
            check_int("min_seq_len", self.min_seq_len, 0, _BIG)
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_int("rows_per_block", self.rows_per_block, 1, self.block_size)
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


# min_seq_len=None / dense_density=None: the default of each device (others take the CPU one); docs/results.md
# holds the measurements they come from.
MIN_SEQ_LEN = {"cpu": 6144, "cuda": 32768}
DENSE_DENSITY = {"cpu": 0.7, "cuda": 0.55}


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


def keep_mass_at(config: BflaConfig, skv: int) -> float | tuple[float, ...]:
    """The ``keep_mass`` a call with ``skv`` keys plans with: ``config.keep_mass`` up to ``keep_mass_ref_len`` keys,
    beyond it ``1 - (1 - keep_mass) · keep_mass_ref_len / skv`` (each value of a per-head tuple alike)."""
    ref = config.keep_mass_ref_len
    if ref is None or skv <= ref:
        return config.keep_mass
    shrink = ref / skv
    if isinstance(config.keep_mass, tuple):
        return tuple(1.0 - (1.0 - km) * shrink for km in config.keep_mass)
    return 1.0 - (1.0 - config.keep_mass) * shrink


def lists_per_query_head(hq: int, hkv: int, config: BflaConfig) -> bool:
    """Whether the plan keeps one list per query head (``head_lists``) for a layer of ``hq`` query / ``hkv`` KV
    heads."""
    if hq == hkv or config.head_lists == "group":
        return False
    return config.head_lists == "head" or hkv == 1
