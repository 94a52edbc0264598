"""gateway.sessions.table.RandomIds across a fork: a child's next id is not its parent's (os.fork, so
the e2e tier; split from tests/unit/test_gateway_units.py)."""

from __future__ import annotations

import os

from gateway.sessions.table import RandomIds


def test_random_ids_are_unique_hex_across_refills_and_forks() -> None:
    ids = RandomIds()
    seen = [ids() for _ in range(1000)]  # about four refills of the buffer
    assert len(set(seen)) == len(seen) and all(len(i) == 32 and int(i, 16) >= 0 for i in seen)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child's next id must not be the parent's
        os.write(writer, ids().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    child_id = os.read(reader, 64).decode()
    os.close(reader)
    assert len(child_id) == 32 and child_id != ids()
