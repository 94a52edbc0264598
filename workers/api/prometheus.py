"""Prometheus helpers both sides use: multiprocess mode with the process id cached.

The gateway and its workers share one PROMETHEUS_MULTIPROC_DIR, so each process calls
``use_cached_pid`` before it creates a metric (gateway/observe/metrics.py, workers/server/metrics.py).
"""

from __future__ import annotations

import os

from prometheus_client import values

_pid = [os.getpid()]


def _remember_pid() -> None:
    _pid[0] = os.getpid()


def use_cached_pid() -> None:
    """Multiprocess mode's values with the process id cached (refreshed after a fork) instead
    of a getpid system call on every increment: it was 4% of the gateway's CPU per request
    (bench.overhead, py-spy). Metrics created after this call use it; idempotent."""
    if getattr(values.ValueClass, "_multiprocess", False) and not getattr(values.ValueClass, "_cached_pid", False):
        values.ValueClass = values.MultiProcessValue(lambda: _pid[0])
        values.ValueClass._cached_pid = True


os.register_at_fork(after_in_child=_remember_pid)
