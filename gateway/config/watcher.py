"""The one watcher of config.yaml while the gateway runs: every part that re-reads the file (the
live policy, gateway/policy_store.py; the API keys, gateway/auth.py) reloads from it.

Two ways in: the file's (mtime, size) changes, polled every ``interval_s`` (polling, not
inotify: it works on every filesystem and for editors that replace the file by renaming; 250 ms
keeps edits visible well within 2 s), and SIGHUP, which reloads whatever the file's stamp says
(an edit that kept both the size and the mtime is seen only then). Each reader validates its own
section and keeps what it runs when that fails; the watcher only says when, and from where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)
ReloadSource = Literal["startup", "file", "sighup", "api"]
Reload = Callable[[ReloadSource], object]  # a reader's reload; what it returns is its own business
FileStamp = tuple[int, int]
POLL_EVERY_S = 0.25


class ConfigWatcher:
    def __init__(self, path: Path | None, reloads: Sequence[Reload], interval_s: float = POLL_EVERY_S) -> None:
        self.path = path
        self.reloads = tuple(reloads)
        self.interval_s = interval_s
        self._stamp = file_stamp(path)  # as the readers loaded it: only a later change reloads

    def reload(self, source: ReloadSource) -> None:
        """Every reader reloads the file now; one that fails unexpectedly does not stop the others."""
        self._stamp = file_stamp(self.path)
        for reload in self.reloads:
            try:
                reload(source)
            except Exception:  # the watcher must outlive any surprise in a file
                log.exception("config reload from %s failed unexpectedly", source)

    async def watch(self) -> None:
        """Polls the file's stamp until cancelled; a change reloads every reader."""
        while True:
            await asyncio.sleep(self.interval_s)
            stamp = file_stamp(self.path)
            if stamp is not None and stamp != self._stamp:
                self.reload("file")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Watches the file, and reloads on SIGHUP, while the block runs (the app's cleanup context)."""
        task = asyncio.create_task(self.watch(), name="config-watcher")
        loop = asyncio.get_running_loop()
        sighup = False
        # No signal handlers off the main thread, or on a loop that cannot have them.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self.reload, "sighup")
            sighup = True
        try:
            yield
        finally:
            if sighup:
                loop.remove_signal_handler(signal.SIGHUP)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def file_stamp(path: Path | None) -> FileStamp | None:
    """(mtime, size) of a watched config file: a change to either triggers a reload. None when
    there is no file, or it cannot be read right now (mid-rename by an editor, say)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
