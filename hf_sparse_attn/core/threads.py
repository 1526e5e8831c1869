"""CPU parallelism for many small torch ops (bfla's CPU inference path, entmax's tiled CPU path): a private worker
pool whose torch ops each run on one thread.

bfla's CPU inference path is hundreds of small ops per layer (the plan's ~60 ops, one or two SDPA calls per query
block and KV head). Under torch's OpenMP intra-op pool every one of them is a parallel region that ends in a
barrier: on an idle machine that costs little, but when another process keeps the cores busy a descheduled
OpenMP thread stalls every barrier. Here the work items run on ``workers`` Python threads instead (torch releases
the GIL inside its kernels), each op single-threaded: no barrier per op, one join per layer.

Intra-op threads are per OS thread under OpenMP and a thread takes torch's global setting at its first op, so the
pool's threads are started (and keep) one intra-op thread; the caller's own setting is restored after every
section (:func:`single_threaded_ops`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

_POOL: ThreadPoolExecutor | None = None
_POOL_KEY: tuple[int, int] = (0, 0)  # (workers, pid): a forked child does not inherit the threads, it builds its own
_POOL_LOCK = threading.Lock()
_PREFIX = "hfsa-cpu"


def _init_worker() -> None:
    torch.set_num_threads(1)  # this OS thread's intra-op setting (under OpenMP: per thread, kept for its lifetime)


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool of ``workers`` threads (rebuilt when the requested size changes, and in a forked
    child, whose copy of the pool has no threads)."""
    global _POOL, _POOL_KEY
    key = (workers, os.getpid())
    with _POOL_LOCK:
        if _POOL is None or _POOL_KEY != key:
            if _POOL is not None and _POOL_KEY[1] == key[1]:
                _POOL.shutdown(wait=True)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=_PREFIX, initializer=_init_worker)
            _POOL_KEY = key
        return _POOL


@contextmanager
def single_threaded_ops() -> Iterator[int]:
    """Within the block torch's intra-op setting is 1 (so threads started inside take 1); yields the caller's
    previous setting, restored on exit."""
    prev = torch.get_num_threads()
    if prev != 1:
        torch.set_num_threads(1)
    try:
        yield prev
    finally:
        if prev != 1:
            torch.set_num_threads(prev)


def parallel_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """``[fn(x) for x in items]`` on ``workers`` pool threads, every torch op inside single-threaded; items are
    handed out one at a time (dynamic balance: pass the costliest first). ``workers <= 1`` or a call from a pool
    thread: inline, one thread."""
    items = list(items)
    with single_threaded_ops():
        if workers <= 1 or len(items) <= 1 or threading.current_thread().name.startswith(_PREFIX):
            # inline: one worker, one item, or called from a pool thread (nested maps would wait on themselves)
            return [fn(x) for x in items]
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def run(x):  # grad / inference mode are thread-local: the workers take the caller's
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(x)

        return list(_pool(workers).map(run, items))
