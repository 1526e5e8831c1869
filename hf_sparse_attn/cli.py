"""Command line: ``hf-sparse-attn {info,demo,eval,bench,finetune,calibrate,lm-eval,serve}``."""

from __future__ import annotations

import argparse
import os
import sys


def _info(_args: argparse.Namespace) -> int:
    import torch
    import transformers

    import hf_sparse_attn

    print(f"hf-sparse-attn {hf_sparse_attn.__version__}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda={torch.cuda.is_available()}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed (Triton kernels unavailable; CPU paths are used)")
    print("methods:", ", ".join(hf_sparse_attn.list_methods()))
    print("model types:", ", ".join(hf_sparse_attn.supported_model_types()))
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    from importlib import import_module

    return int(import_module(module).main(argv) or 0)


_SUBCOMMANDS = {
    "eval": "hf_sparse_attn.eval.cli",
    "demo": "hf_sparse_attn.eval.demo",
    "bench": "hf_sparse_attn.tools.bench",
    "finetune": "hf_sparse_attn.finetune",
    "calibrate": "hf_sparse_attn.tools.calibrate",
    "lm-eval": "hf_sparse_attn.eval.harness_cli",
    "serve": "hf_sparse_attn.tools.serve",
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SUBCOMMANDS:
        return _delegate(_SUBCOMMANDS[argv[0]], argv[1:])
    parser = argparse.ArgumentParser(prog="hf-sparse-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, registered methods, supported model types").set_defaults(fn=_info)
    for name in _SUBCOMMANDS:
        sub.add_parser(name, help=f"see `hf-sparse-attn {name} --help`")
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
