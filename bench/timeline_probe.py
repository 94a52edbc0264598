"""``python -m bench.timeline_probe gateway|workers ARGS``: ``python -m gateway|workers ARGS``
with a timestamp at each hand-off of a request (bench.timeline).

The probes wrap, by name, the functions a request passes through: the gateway's outermost
middleware (``gateway.relay.app.count_requests``: in), its worker request
(``gateway.relay.relay.open_stream``: sent, and the response's head back), the answer ready to
write (``gateway.relay.relay._answer_response``: out; the gateway writes it next, and accounts it
after the write: ``gateway.relay.relay._answer``), and the worker's request handler
(``workers.server.app._serve``: in and out, its answer then written by aiohttp).
``time.monotonic`` is one clock for every process on the machine, so bench.timeline can line the
marks of the client, the gateway and the worker up per request. A wrapped function
that is gone fails the start, not the figures.
At exit the marks go to ``$SPECGATE_TIMELINE_OUT.<module>.<pid>.json``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

OUT_ENV = "SPECGATE_TIMELINE_OUT"
MARKS: dict[str, list[float]] = {}


def _probe(module: ModuleType, name: str, enter: str | None, leave: str | None) -> None:
    original: Callable[..., Awaitable[Any]] = getattr(module, name)  # AttributeError: the probe is stale
    enter_marks = MARKS.setdefault(enter, []) if enter else None
    leave_marks = MARKS.setdefault(leave, []) if leave else None

    @functools.wraps(original)  # keeps aiohttp's middleware marker
    async def probed(*args: Any, **kwargs: Any) -> Any:
        if enter_marks is not None:
            enter_marks.append(time.monotonic())
        try:
            return await original(*args, **kwargs)
        finally:
            if leave_marks is not None:
                leave_marks.append(time.monotonic())

    setattr(module, name, probed)


def _probe_leaving(module: ModuleType, name: str, leave: str) -> None:
    """A mark as a plain function returns."""
    original: Callable[..., Any] = getattr(module, name)  # AttributeError: the probe is stale
    leave_marks = MARKS.setdefault(leave, [])

    @functools.wraps(original)
    def probed(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            leave_marks.append(time.monotonic())

    setattr(module, name, probed)


def install(target: str) -> None:
    if target == "gateway":
        import gateway.relay.app
        import gateway.relay.relay

        _probe(gateway.relay.app, "count_requests", "gateway_in", None)
        _probe(gateway.relay.relay, "open_stream", "to_worker", "from_worker")
        _probe_leaving(gateway.relay.relay, "_answer_response", "gateway_out")
    import workers.server.app

    _probe(workers.server.app, "_serve", "worker_in", "worker_out")


def _dump(target: str) -> None:
    Path(f"{os.environ[OUT_ENV]}.{target}.{os.getpid()}.json").write_text(json.dumps(MARKS))


def main() -> None:
    target = sys.argv[1]
    if target not in ("gateway", "workers"):
        raise SystemExit(f"python -m bench.timeline_probe gateway|workers ARGS, not {target!r}")
    install(target)
    atexit.register(_dump, target)
    sys.argv = [target, *sys.argv[2:]]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
