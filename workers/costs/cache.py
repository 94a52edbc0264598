"""The on-disk cache of start-up cost measurements, so a restarted worker is ready at once. No torch.

An entry is keyed by everything the figures depend on: the report's schema version, the CPU
(model name and the vector extensions that pick kernels), the torch version, the model files
(path, size, mtime) and the worker's settings. Workers that share a cache directory take the entry's lock while they
measure, so the workers of one gateway, started together, measure once and agree on one
precision: the first measures and writes, the others wait and read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from workers.costs.cost_report import CostReport

log = logging.getLogger(__name__)
# What a cached report means: bumped whenever the measurement or the schema changes, so a
# worker never serves figures measured under another definition (2: the step's work outside
# its forwards, step_overhead_ms and draft_overhead_ms; entries without it are measured again).
SCHEMA_VERSION = 12  # 3: plain steps timed back to back; 4: verifying ones after a draft forward; 5: prefills;
# 6: every depth's plain step and K=1 step before the deeper shapes in n; 7: a step's first draft forward apart;
# 8: the draft multiplies as the chosen target does (bfloat16 products), each candidate priced with its own draft;
# 9: a depth whose deeper-K draft phase is no longer than K = 1's is no measurement (it priced later forwards free);
# 10: token trees' verification and draft-level costs (tree_verify_cost, tree_draft_cost);
# 11: dtype auto measures no bfloat16 weights for a checkpoint stored in float32 (measurement/precision.py);
# 12: a depth timed plain only takes its verification from the plain steps' growth in rows (measure.shape_by_rows)
# The CPU features that decide which matmul kernels run (and so what a step costs).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def cpu_label() -> str:
    """"<model name> (<kernel flags>)", e.g. "AMD EPYC (avx2)": how figures are labelled."""
    name, flags = platform.processor() or platform.machine(), set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return f"{name} ({' '.join(f for f in KERNEL_FLAGS if f in flags) or 'no AVX2'})"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base) / "specgate" / "costs"


def _file_stamp(path: Path) -> list[Any]:
    try:
        st = path.stat()
    except OSError:
        return [str(path), None]
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cache_key(model_dirs: Mapping[str, Path | None], settings: Mapping[str, Any], torch_version: str) -> str:
    files = {role: None if d is None else [_file_stamp(d / name) for name in ("config.json", "model.safetensors")]
             for role, d in model_dirs.items()}
    material = {"schema": SCHEMA_VERSION, "cpu": cpu_label(), "torch": torch_version, "files": files,
                "settings": dict(settings)}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


class CostCache:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory or default_cache_dir()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            # A read-only home: a temp dir still spares restarts on this boot.
            self.directory = Path(tempfile.gettempdir()) / "specgate-costs"
            self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Held while one worker measures; the others wait here, then read what it wrote."""
        with (self.directory / f"{key}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def load(self, key: str) -> CostReport | None:
        try:
            raw = json.loads(self.path(key).read_text())
            return CostReport.from_json(raw["report"]) if raw.get("key") == key else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a torn or stale-format entry: measure again
            log.warning("ignoring cost cache entry %s: %s", self.path(key), exc)
            return None

    def store(self, key: str, report: CostReport) -> None:
        # Written whole to a temp file and renamed, so a reader never sees half an entry.
        tmp = self.path(key).with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "report": report.to_json()}))
        os.replace(tmp, self.path(key))
