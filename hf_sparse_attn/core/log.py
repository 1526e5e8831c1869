"""The package logger and log-once notices (a skipped fast path is logged once per distinct reason)."""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_sparse_attn")

_LOGGED: set[str] = set()


def log_once(reason: str) -> None:
    """Log a fast-path skip (or other notice) once per distinct reason."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning(reason)
