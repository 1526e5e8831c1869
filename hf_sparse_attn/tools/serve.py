"""``hf-sparse-attn serve``: transformers' OpenAI-compatible server (``transformers serve``) with every model it loads
patched by a sparse-attention method.

The server, its endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``,
``/health``, ...) and their behaviour are transformers' own; only the loading differs
(:mod:`hf_sparse_attn.tools.serve_loader`): a model is patched with ``--method`` right after it loads, and offline
aliases (``smollm2``, ...) read their converted local folders. Continuous batching is on by default; the patched model
then runs under :data:`~hf_sparse_attn.VARLEN_ATTN_NAME`, the flash-named alias transformers admits there.

Options of this command: the model, ``--method``, ``--method-config``, ``--layers``, ``--from-pretrained``,
``--host``, ``--port``, ``--[no-]continuous-batching``. Every other option of ``transformers serve`` (``--dtype``,
``--device``, ``--cb-num-blocks``, ``--max-model-len``, ``--log-level``, ...) is passed through unchanged, except
``--attn-implementation`` (the method sets the attention). See docs/serving.md.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import os
import sys
import types
import typing
from typing import Any

__all__ = ["build_parser", "main"]

# Options of `transformers serve` this command defines itself (with its own defaults) or refuses.
_OWN = {"force_model", "host", "port", "continuous_batching"}
_REFUSED = {"attn_implementation": "the attention implementation is set by --method (patch_model); drop it"}
_PASS_PREFIX = "serve__"


def _serve_options() -> list[tuple[str, Any, str]]:
    """``(name, type, help)`` of each parameter of transformers' ``Serve`` command (``transformers serve``), read from
    its signature: ``Annotated[type, typer.Option(help=...)]``, ``X | None`` read as ``X``."""
    from transformers.cli.serve import Serve

    try:
        signature = inspect.signature(Serve, eval_str=True)
    except Exception:  # an annotation that only resolves under TYPE_CHECKING: read them as written
        signature = inspect.signature(Serve)
    options = []
    for name, param in signature.parameters.items():
        kind, text = param.annotation, ""
        if typing.get_origin(kind) is typing.Annotated:
            kind, *extras = typing.get_args(kind)
            text = next((e.help for e in extras if isinstance(getattr(e, "help", None), str)), "")
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), str)
        options.append((name, kind, text))
    return options


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-sparse-attn serve`` parser: this command's options, then those of ``transformers serve`` that pass
    through (read from its signature, so they follow the installed transformers)."""
    from hf_sparse_attn.finetune.options import layers_arg

    p = argparse.ArgumentParser(
        prog="hf-sparse-attn serve",
        description="transformers serve (an OpenAI-compatible server) with each model patched by a sparse-attention "
        "method (hf_sparse_attn.patch_model). Endpoints: /v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/models, /health.",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="model served (and loaded at start): a local Hugging Face folder or an offline alias "
                        "(hf_sparse_attn.models: smollm2, gemma3-270m, qwen2-smollm2); omitted: each request's "
                        "`model` is loaded on demand (local folders or aliases), and patched")
    g = p.add_argument_group("sparse attention")
    g.add_argument("--method", default="bfla", help="attention method (hf_sparse_attn.list_methods()); default bfla")
    g.add_argument("--method-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="method options, values parsed as JSON/Python literals (e.g. keep_mass=0.9 min_seq_len=0)")
    g.add_argument("--layers", type=layers_arg, default=None,
                   help="'all', 'eligible' or comma-separated layer indices (default: the method's default)")
    g.add_argument("--from-pretrained", default=None, metavar="DIR",
                   help="a PatchHandle.save folder whose learned parameters (α, δ/β, s, ...) are loaded")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="localhost", help="listen address (default localhost)")
    g.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    g.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=True,
                   help="continuous batching (default on): the patched model runs under the flash-named alias "
                        "hf_sparse_attn_flash_varlen, one method call per packed sequence")
    g = p.add_argument_group("transformers serve options", "passed through unchanged (`transformers serve --help`)")
    for name, kind, text in _serve_options():
        if name in _OWN:
            continue
        flag, dest, text = "--" + name.replace("_", "-"), _PASS_PREFIX + name, text.replace("%", "%%")
        if name in _REFUSED:
            g.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif kind is bool:
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            g.add_argument(flag, dest=dest, choices=[m.value for m in kind], default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(flag, dest=dest, type=kind if kind in (int, float) else str, default=argparse.SUPPRESS,
                           metavar=name.upper(), help=text)
    return p


def _missing_serving() -> str | None:
    """Why transformers' server cannot run here (its serving package or the ``serve`` extra is missing), or None."""
    import transformers

    try:
        from transformers.cli.serving.model_manager import ModelLoader  # noqa: F401
    except ImportError as err:
        return (f"hf-sparse-attn serve needs transformers' serving package with ModelLoader "
                f"(transformers.cli.serving.model_manager, transformers 5.25 is tested); transformers "
                f"{transformers.__version__} has none ({err})")
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return "hf-sparse-attn serve needs FastAPI, uvicorn, pydantic and openai: pip install 'hf-sparse-attn[serve]'"
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, check it, then serve until stopped (Ctrl+C / SIGTERM). Returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    missing = _missing_serving()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    from hf_sparse_attn.finetune.options import parse_method_config
    from hf_sparse_attn.tools.serve_loader import PatchedServe, PatchSettings, model_folder_or_alias

    parser = build_parser()
    args = parser.parse_args(argv)
    passed = {k[len(_PASS_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_PASS_PREFIX)}
    for name, why in _REFUSED.items():
        if name in passed:
            parser.error(f"--{name.replace('_', '-')} {passed[name]!r}: {why}")
    try:
        settings = PatchSettings(
            method=args.method,
            method_config=parse_method_config(args.method_config),
            layers=args.layers,
            from_pretrained=None if args.from_pretrained is None else os.path.abspath(args.from_pretrained),
            continuous_batching=args.continuous_batching,
        )
    except ValueError as err:  # names --method-config
        parser.error(str(err))
    try:
        settings.validate()
    except ValueError as err:
        parser.error(str(err))
    if args.model is not None:
        try:
            model_folder_or_alias(args.model)
        except (ValueError, ImportError) as err:  # ImportError: an alias whose PyPI package is missing
            parser.error(str(err))
    try:
        PatchedServe(
            settings,
            force_model=args.model,
            host=args.host,
            port=args.port,
            continuous_batching=args.continuous_batching,
            **passed,
        )
    except RuntimeError as err:  # a model that failed to load or patch, an engine that died: logged above in full
        print(f"hf-sparse-attn serve: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
