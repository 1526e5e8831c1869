"""lm-evaluation-harness model ``hf-sparse-attn``: lm-eval's ``hf`` model (``HFLM``), patched after loading.

::

    hf-sparse-attn lm-eval --model hf-sparse-attn \\
        --model_args pretrained=smollm2,method=bfla,keep_mass=0.95 --tasks hfsa_niah_single_1 ...

``--model_args``: ``pretrained`` (a local folder, a Hub id in the local cache, or one of our offline aliases:
``smollm2``, ``gemma3-270m``, ``qwen2-smollm2``), ``method`` (default ``dense``), ``layers``, and every option of
the method's config (``keep_mass``, ``alpha``, a bfla ``profile`` once bfla has one, ...: validated by
``patch_model``, same ``ValueError``); every other key is one of ``HFLM``'s own (``dtype``, ``max_length``,
``batch_size``, ...). ``dense_baseline=True`` checks the method options but runs the model dense (the baseline half
of ``hf-sparse-attn lm-eval --paired``).

With ``batch_size=1`` and greedy decoding (every hfsa_ task), each request is decoded by the same greedy loop as
``hf-sparse-attn eval`` (:func:`hf_sparse_attn.eval.decode.greedy_decode`), which times the prefill (time to first
token) and reads the method's measured density right after it; :attr:`SparseAttnLM.prefill_records` holds one
record per request (task, doc_id, prompt tokens, prefill seconds, density) and :meth:`write_prefill_stats` writes
them beside lm-eval's logged samples. Other settings (batches, sampling) use ``HFLM``'s own ``generate`` (logged
once; no timings then). The method, its config and the mean measured density go into lm-eval's
``results["config"]``.

Data parallel: as lm-eval's ``hf`` model (``accelerate launch -m hf_sparse_attn.eval.harness_cli ...``): each
process loads the model and patches its own copy.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.eval.harness_tasks import resolve_pretrained

INSTALL_HINT = 'pip install "hf-sparse-attn[eval]"'

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test without lm_eval
    raise ImportError(f"the lm-evaluation-harness integration needs lm-eval>=0.4.13: {INSTALL_HINT}") from exc

logger = logging.getLogger(__name__)

MODEL_NAME = "hf-sparse-attn"
#: HFLM's own keyword arguments, plus the ``from_pretrained`` keywords HFLM forwards that we let through.
_HFLM_ARGS = (frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}) | {
    "attn_implementation",
    "low_cpu_mem_usage",
}
_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.warning(msg)


def split_model_args(method: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(HFLM kwargs, method options)``: keys of ``HFLM.__init__`` go to HFLM, the rest are method options,
    checked now against the method's config (``ValueError`` naming the key, as ``patch_model``)."""
    from hf_sparse_attn.methods import get_method

    hf = {k: v for k, v in kwargs.items() if k in _HFLM_ARGS}
    options = {k: v for k, v in kwargs.items() if k not in _HFLM_ARGS}
    get_method(method).make_config(**options)
    return hf, options


@register_model(MODEL_NAME)
class SparseAttnLM(HFLM):
    """``HFLM`` whose model is patched with ``hf_sparse_attn.patch_model(model, method, layers, **options)``."""

    #: Set by ``hf-sparse-attn lm-eval`` (None otherwise): the instances it built, to write their prefill records.
    instances: list[SparseAttnLM] | None = None

    def __init__(
        self,
        pretrained: str | Any,
        method: str = "dense",
        layers: str | list[int] | None = None,
        dense_baseline: bool = False,
        **kwargs: Any,
    ) -> None:
        from hf_sparse_attn import patch_model

        hf_kwargs, options = split_model_args(method, kwargs)
        if isinstance(pretrained, str):
            folder, tok_folder = resolve_pretrained(pretrained)
            pretrained = folder
            hf_kwargs.setdefault("tokenizer", tok_folder)
        super().__init__(pretrained=pretrained, **hf_kwargs)
        self.sparse_method = method
        self.method_options = options
        self.dense_baseline = bool(dense_baseline)
        self.handle = None
        if method != "dense" and not self.dense_baseline:
            self.handle = patch_model(self.model, method=method, layers=layers, **options)
        self.prefill_records: list[dict[str, Any]] = []
        self._request: Any = None
        if SparseAttnLM.instances is not None:
            SparseAttnLM.instances.append(self)

    # -- results config ------------------------------------------------------------------------------
    def mean_density(self) -> float | None:
        """Mean measured density over the recorded prefills (1.0 when dense; None before any)."""
        xs = [r["density"] for r in self.prefill_records if r["density"] is not None]
        return sum(xs) / len(xs) if xs else None

    def get_model_info(self) -> dict[str, Any]:
        info = dict(super().get_model_info())
        info.update(
            sparse_method="dense" if self.dense_baseline else self.sparse_method,
            sparse_method_config=self.handle.config.to_dict() if self.handle is not None else dict(self.method_options),
            sparse_dense_baseline_of=self.sparse_method if self.dense_baseline else None,
            sparse_measured_density=self.mean_density(),
            sparse_prefill_records=len(self.prefill_records),
        )
        return info

    # -- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One request at a time (batch size 1), so each prefill is timed and tied to its (task, doc_id)."""
        if str(self.batch_size) != "1":
            _log_once(f"hf-sparse-attn: batch_size={self.batch_size}: no per-sample prefill timing (needs 1)")
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        from tqdm.auto import tqdm

        out: list[str] = []
        for req in tqdm(requests, desc="hf-sparse-attn generate", disable=disable_tqdm or self.rank != 0):
            self._request = req
            try:
                out += super().generate_until([req], disable_tqdm=True)
            finally:
                self._request = None
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        greedy = not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature")
        mask = generation_kwargs.get("attention_mask")
        if context.shape[0] != 1 or not greedy or (mask is not None and not bool(mask.all())):
            _log_once("hf-sparse-attn: sampling or batched generation: HFLM's generate, no prefill timing")
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        from hf_sparse_attn.eval.decode import eos_ids, greedy_decode

        handle = self.handle
        density_now = (lambda: handle.stats()["density"]) if handle is not None else (lambda: 1.0)
        new, prefill_s, density = greedy_decode(
            self.model, context, max_length - context.shape[1], eos_ids(self.model, self.tokenizer), density_now
        )
        req = self._request
        self.prefill_records.append(
            {
                "task": getattr(req, "task_name", None),
                "doc_id": getattr(req, "doc_id", None),
                "method": "dense" if handle is None else self.sparse_method,
                "prompt_tokens": int(context.shape[1]),
                "new_tokens": len(new),
                "prefill_s": prefill_s,
                "density": density,
            }
        )
        tail = torch.tensor([new], dtype=context.dtype, device=context.device)
        return torch.cat([context, tail], dim=1)

    # -- output ----------------------------------------------------------------------------------------
    def write_prefill_stats(self, folder: str | Path, stamp: str | None = None) -> Path:
        """Write :attr:`prefill_records` as ``prefill_<stamp>.jsonl`` into ``folder`` (lm-eval's samples folder)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"prefill_{stamp or time.strftime('%Y-%m-%dT%H-%M-%S')}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for rec in self.prefill_records:
                fh.write(json.dumps(rec) + "\n")
        return path
