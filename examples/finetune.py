"""Fine-tune a model with sparse attention layers using accelerate (see ``hf_sparse_attn.finetune``).

    # one CPU process
    accelerate launch --cpu examples/finetune.py --model tiny-llama --method entmax --learn-alpha \
        --synthetic-retrieval --seq-len 256 --steps 20 --output-dir runs/ft-tiny
    # two CPU processes (DDP over gloo; `--cpu --num_processes 2` would start only one without MPI)
    CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --model tiny-llama ...
    # SmolLM2 softmax -> 1.5-entmax with α annealing and LoRA, on local text files
    accelerate launch examples/finetune.py --model smollm2 --method entmax --alpha-anneal-steps 50 --lora \
        --train-file "corpus/*.txt" --seq-len 1024 --steps 200 --output-dir runs/ft-smollm2

Same flags as ``hf-sparse-attn finetune``; ``--help`` lists them. Reload the result with
``hf_sparse_attn.finetune.load_finetuned(output_dir)``.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_sparse_attn.finetune import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
