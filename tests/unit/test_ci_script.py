"""CI runs what a user runs: .ci/run calls make targets and installs nothing of its own, so a
fresh machine's `make test` (README) needs no step that only CI takes (issue #42)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALLERS = re.compile(r"\b(apt-get|apt|dpkg|pip3?|python3? -m pip|npm|curl|wget|uv)\b")


def ci_commands(text: str) -> list[str]:
    """The script's command lines (comments and blank lines dropped)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def installs_of_its_own(text: str) -> list[str]:
    return [line for line in ci_commands(text) if INSTALLERS.search(line)]


def test_ci_installs_nothing_that_make_does_not() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert installs_of_its_own(script) == []
    makes = re.findall(r"\bmake ([\w-]+)", script)
    assert "test" in makes and "test-vllm" in makes and "test-llamacpp" in makes
    assert set(makes) <= {"install", "install-vllm", "install-llamacpp", "test", "test-vllm", "test-llamacpp"}


def test_make_test_brings_the_system_packages_the_tests_run() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: install system-deps$", makefile, re.M)
    packages = re.search(r"^SYSTEM_PACKAGES := (.+)$", makefile, re.M)
    assert packages is not None and set(packages.group(1).split()) >= {"redis-server", "prometheus"}


def test_the_check_sees_an_install_step_ci_would_take_alone() -> None:
    """The check itself: a script that installs a package on its own is caught."""
    assert installs_of_its_own("set -e\n# apt-get in a comment is fine\napt-get install -y redis-server\nmake test\n") \
        == ["apt-get install -y redis-server"]
    assert installs_of_its_own("python3 -m pip install foo\n") == ["python3 -m pip install foo"]
    assert installs_of_its_own("make test\n") == []
