"""The unit tier: tests that start no process. An autouse fixture fails any test that tries
(subprocess, asyncio subprocesses, fork/spawn, multiprocessing), naming what it called: such a
test belongs in tests/e2e/."""

from __future__ import annotations

import asyncio
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest


def _refuse(what: str) -> Callable[..., NoReturn]:
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        pytest.fail(f"a unit test may not start a process ({what} was called); "
                    "real processes belong in tests/e2e/", pytrace=False)

    return refused


@pytest.fixture(scope="module", autouse=True)
def _no_processes() -> Iterator[None]:
    """Module-scoped, so that a module's own module-scoped fixtures are refused too."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _refuse_all(monkeypatch)
        yield


def _refuse_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # Popen's _execute_child is where every subprocess helper (run, check_output, asyncio's
    # transports) ends up; the others are refused at their own names for a clearer message.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess.Popen"))
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse("asyncio.create_subprocess_exec"))
    monkeypatch.setattr(asyncio, "create_subprocess_shell", _refuse("asyncio.create_subprocess_shell"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve", "spawnvp",
                 "spawnvpe", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing start"))
