"""A training run's checkpoint, written atomically and read back only by a run with the same settings
(models/distill_train.py, models/eagle3_train.py): a rerun resumes where the last one stopped; and the
seconds a work directory's stages took over every run (``times.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Written beside and renamed into place: an interrupted save leaves the last checkpoint whole."""
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_checkpoint(path: Path, field: str, expected: object) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None: there is none); ValueError when its ``field`` (the settings
    it was made with) is not ``expected``."""
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, weights_only=True)
    if state[field] != expected:
        raise ValueError(f"{path}: made with {state[field]}, this run asks for {expected}; "
                         "use the same settings or another --work")
    return state


def add_time(work: Path, key: str, seconds: float) -> None:
    """Adds ``seconds`` to ``key`` in the work directory's ``times.json`` (a stage spread over runs)."""
    path = work / "times.json"
    times = json.loads(path.read_text()) if path.is_file() else {}
    times[key] = times.get(key, 0.0) + seconds
    path.write_text(json.dumps(times) + "\n")
