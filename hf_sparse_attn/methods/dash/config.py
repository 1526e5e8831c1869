"""dash's options (``patch_model(model, method="dash", **options)``), validated; the maths: docs/methods/dash.md."""

from __future__ import annotations

from dataclasses import dataclass

from hf_sparse_attn.core.checks import check_bool, check_choice, check_int, check_range
from hf_sparse_attn.methods.base import MethodConfig
from hf_sparse_attn.ops.dash.attention import DashShape

BLOCK_SIZES = (16, 32, 64, 128, 256)
POOLINGS = ("attention", "mean")


@dataclass
class DashConfig(MethodConfig):
    """* ``block_size``: keys per block (the stage-2 tile), one of 16, 32, 64, 128, 256.
    * ``alpha``: α of the stage-1 entmax over blocks, in (1, 2].
    * ``temperature``: the initial per-head θ multiplying the block scores (higher = sparser), in (0, 1000].
    * ``pooling``: ``"attention"`` (a learned query per KV head, zero-initialised = mean pooling) or ``"mean"``.
    * ``prior_strength``: λ of the log-prior bias ``λ·(log π - m)`` in [0, 100] (0: plain softmax over the support).
    * ``center_prior``: subtract the row's largest ``log π``, so the strongest selected block competes with the
      always-on blocks at bias 0 and λ only weighs the selected blocks against it.
    * ``sink_blocks`` / ``local_blocks``: always-on blocks at the start / before the row's own block, in [0, 64].
    * ``learn``: the pooling query and the temperatures are trainable parameters (else fixed buffers).
    """

    block_size: int = 64
    alpha: float = 1.5
    temperature: float = 1.0
    pooling: str = "attention"
    prior_strength: float = 1.0
    center_prior: bool = True
    sink_blocks: int = 1
    local_blocks: int = 1
    learn: bool = True

    def validate(self) -> None:
        check_choice("block_size", self.block_size, BLOCK_SIZES)
        check_range("alpha", self.alpha, 1.0, 2.0, low_open=True)
        check_range("temperature", self.temperature, 0.0, 1000.0, low_open=True)
        check_choice("pooling", self.pooling, POOLINGS)
        check_range("prior_strength", self.prior_strength, 0.0, 100.0)
        check_bool("center_prior", self.center_prior)
        check_int("sink_blocks", self.sink_blocks, 0, 64)
        check_int("local_blocks", self.local_blocks, 0, 64)
        check_bool("learn", self.learn)

    def shape(self) -> DashShape:
        return DashShape(self.block_size, float(self.alpha), float(self.prior_strength), self.center_prior,
                         self.sink_blocks, self.local_blocks)
