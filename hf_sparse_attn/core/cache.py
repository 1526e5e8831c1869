"""A memo for small tensors built from shapes alone (tile masks, block grids)."""

from __future__ import annotations

import functools

import torch


def shape_cached(fn):
    """Memoize a function of plain positional arguments (ints, None; the device last) that builds small tensors from
    shapes alone (the 16 most recent argument sets are kept).

    Every layer of one prefill asks for the same tile masks; on a GPU each rebuild is a dozen small kernel launches.
    The tensors are built outside inference mode (so later training can use them) and are shared: callers must not
    modify them in place. Not memoized while ``torch.compile`` traces."""
    memo = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        with torch.inference_mode(False):
            return memo(*args[:-1], torch.device(args[-1]))

    wrapper.cache_clear = memo.cache_clear
    return wrapper
