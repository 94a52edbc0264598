"""A process's resident memory, and handing freed heap back to the system (Linux, glibc)."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def resident_bytes(pid: int | None = None) -> int:
    """The resident set of process ``pid`` (None: this one), from ``/proc/<pid>/statm``."""
    statm = Path(f"/proc/{'self' if pid is None else pid}/statm").read_text()
    return int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")


def return_freed_heap() -> int:
    """Hand the heap's free pages back to the kernel; the MiB the resident set fell by. A first
    start measures a target per candidate precision with scratch caches and keeps one: glibc
    keeps the rest mapped (a real-pair worker stayed at 2.9 GiB after a first start against
    1.0 GiB after one that read its costs from the cache) until asked (``malloc_trim``). A no-op
    off glibc or without ``/proc``."""
    gc.collect()
    try:
        before = resident_bytes()
        ctypes.CDLL(None).malloc_trim(0)
        freed = max(0, before - resident_bytes()) // 2**20
    except (AttributeError, OSError):  # not glibc, or no /proc
        return 0
    log.info("returned %d MiB of freed heap to the system", freed)
    return freed
