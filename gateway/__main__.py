"""``python -m gateway --config config.yaml [--host H] [--port P]``: ``specgate serve`` (gateway/cli.py)."""

from __future__ import annotations

import sys

from gateway.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
