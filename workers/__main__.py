"""Worker process entry point: ``python -m workers --target DIR --draft DIR (--uds PATH | --port N)``.

``--engine`` picks what runs the models: ``embedded`` (PyTorch, this repo), ``vllm`` (vLLM's
AsyncLLM with specgate's per-request scheduler plugin; run this with the vLLM environment's
interpreter), ``sim`` (a simulated GPU deployment, ``--sim-config``; no torch). The HTTP server,
protocol and metrics are the same for every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only the standard library before the log format is set (main): a warning raised while the
# server's modules (aiohttp, prometheus_client) or an engine's (torch, vLLM) are imported
# then comes out in that format.
from workers.api.limits import prefix_cache_problem
from workers.api.logs import LOG_FORMATS, WORKER_ATTR, configure

if TYPE_CHECKING:
    from workers.engines.interface import Engine

TOKEN_ENV = "SPECGATE_WORKER_TOKEN"


def parse_args(argv: list[str] | None = None, prog: str = "python -m workers") -> argparse.Namespace:
    # Pure Python, no torch: the lookup knobs' defaults and checks live with the proposers.
    from workers.engines.embedded.lookup.proposer import LookupSettings, LookupSettingsError

    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--worker-id", default=f"worker-{os.getpid()}")
    parser.add_argument("--engine", choices=["embedded", "vllm", "sim"], default="embedded")
    parser.add_argument("--target", type=Path, required=True, help="target model directory (Hugging Face format)")
    parser.add_argument("--draft", type=Path, default=None, help="draft model directory; omit for plain only")
    parser.add_argument("--eagle3", type=Path, default=None,
                        help="an EAGLE-3 head directory (speculators' eagle3 format): the eagle3 method")
    parser.add_argument("--served-model-name", default="specgate-demo")
    parser.add_argument("--max-slots", type=int, default=16)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--default-k", type=int, default=6)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "q4_1"], default="auto",
                        help="the target's dtype; auto: measured at start-up among bfloat16, float32 and the "
                             "GGUF's q4_1 blocks where make install laid them out (embedded); the checkpoint's "
                             "own dtype (vllm, which has no q4_1)")
    parser.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the draft's dtype (embedded; vLLM runs the draft in the target's dtype)")
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                        help="embedded, --dtype auto: choose only among configurations whose verification is "
                             "bit-identical to plain decoding on this CPU (--no-exact admits faster, close ones)")
    parser.add_argument("--cost-cache-dir", type=Path, default=None,
                        help="embedded: where start-up cost measurements are cached (default ~/.cache/specgate/costs)")
    parser.add_argument("--cost-budget-s", type=float, default=4.0,
                        help="embedded: time budget of the start-up cost measurement (a cache hit skips it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads: torch's intra-op threads and the float32 kernels'")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the context window: prompt + generation, the longest sequence a KV slot holds "
                             "(default: the model's max_position_embeddings)")
    parser.add_argument("--prompt-lookup-min", type=int, default=LookupSettings.prompt_lookup_min,
                        help="embedded, method ngram: the shortest n-gram prompt lookup matches (vLLM's name)")
    parser.add_argument("--prompt-lookup-max", type=int, default=LookupSettings.prompt_lookup_max,
                        help="embedded, method ngram: the longest n-gram, tried first")
    parser.add_argument("--suffix-cache-bytes", type=int, default=LookupSettings.suffix_cache_bytes,
                        help="embedded, method suffix: the memory bound of the worker's store of earlier prompts "
                             "and outputs (0: none kept)")
    parser.add_argument("--prefix-cache-mb", type=float, default=0.0,
                        help="embedded: MiB of prompt K/V kept for reuse by later requests with the same start "
                             "(0: none; config.yaml's workers.prefix_cache_mb)")
    parser.add_argument("--vllm-args", type=json.loads, default={},
                        help="vllm: further AsyncEngineArgs as a JSON object, e.g. '{\"enforce_eager\": true}'")
    parser.add_argument("--sim-config", type=json.loads, default={},
                        help="sim: the simulated deployment as a JSON object (config.yaml's workers.sim; docs/sim.md)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--uds", type=Path, help="listen on this Unix domain socket")
    where.add_argument("--port", type=int, help="listen on TCP (with --host)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="log lines as text or one JSON object each, with the worker id (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="with --port; an address other than loopback needs the gateway's token "
                             f"(the {TOKEN_ENV} environment variable)")
    args = parser.parse_args(argv)
    if args.engine == "embedded":  # checked before any model loads
        problem = prefix_cache_problem(args.prefix_cache_mb)
        if problem is not None:
            parser.error(f"--prefix-cache-mb (workers.prefix_cache_mb) {args.prefix_cache_mb!r} {problem}")
        try:
            LookupSettings(args.prompt_lookup_min, args.prompt_lookup_max, args.suffix_cache_bytes)
        except LookupSettingsError as error:
            parser.error(str(error))
    elif args.dtype == "q4_1":
        parser.error(f"--dtype q4_1 (workers.dtype) is the embedded engine's; engine {args.engine} serves the "
                     "float32 conversion")
    return args


def build_engine(args: argparse.Namespace) -> Engine:
    # Each engine's module is imported only when chosen: vLLM lives in its own environment.
    if args.engine == "vllm":
        from workers.engines.vllm import VllmEngine, VllmSettings

        return VllmEngine(VllmSettings(target=args.target, draft=args.draft, max_slots=args.max_slots,
                                       max_k=args.max_k, dtype=args.dtype, max_model_len=args.max_model_len,
                                       threads=args.threads, engine_args=args.vllm_args, eagle3=args.eagle3))
    if args.engine == "sim":  # imports no torch: the sim runs no model
        from workers.api.sim_config import SimConfig
        from workers.engines.sim.engine import SimEngine, SimSettings

        return SimEngine(SimSettings(tokenizer_dir=args.target, max_slots=args.max_slots, max_k=args.max_k,
                                     config=SimConfig.from_mapping(args.sim_config)))
    import torch

    from workers.engines.embedded.adapter import EmbeddedEngine, EmbeddedSettings

    torch.set_num_threads(args.threads)
    return EmbeddedEngine(EmbeddedSettings(target=args.target, draft=args.draft, max_slots=args.max_slots,
                                           max_k=args.max_k, dtype=args.dtype, draft_dtype=args.draft_dtype,
                                           exact=args.exact, cost_cache_dir=args.cost_cache_dir,
                                           cost_budget_s=args.cost_budget_s, max_model_len=args.max_model_len,
                                           prompt_lookup_min=args.prompt_lookup_min,
                                           prompt_lookup_max=args.prompt_lookup_max,
                                           suffix_cache_bytes=args.suffix_cache_bytes,
                                           prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)),
                                           eagle3=args.eagle3))


def die_with_parent() -> None:
    """A local worker belongs to its gateway: if the gateway dies (even by kill -9), so does it."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def main(argv: list[str] | None = None, prog: str = "python -m workers") -> int:
    args = parse_args(argv, prog)
    if args.uds is not None:
        die_with_parent()
    configure(args.log_format, "INFO", name=args.worker_id, fields={WORKER_ATTR: args.worker_id})
    import uvloop

    from workers.api.tokens import is_loopback
    from workers.api.web_runner import run_app
    from workers.server.app import create_worker_app
    from workers.server.context import WorkerSettings

    # From the environment, never the command line, where every user of the machine can read it.
    token = os.environ.get(TOKEN_ENV) or None
    if args.port is not None and token is None and not is_loopback(args.host):
        print(f"specgate worker: --host {args.host} is not a loopback address: set {TOKEN_ENV} (the gateway's "
              "workers.token) so that only the gateway is served", file=sys.stderr)
        return 2
    settings = WorkerSettings(
        worker_id=args.worker_id, tokenizer_dir=args.target, served_model_name=args.served_model_name,
        default_k=args.default_k, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        token=token if args.port is not None else None)  # a Unix socket is private to its gateway
    app = create_worker_app(settings, build_engine(args))
    uvloop.install()
    if args.uds is not None:
        args.uds.unlink(missing_ok=True)
        run_app(app, path=args.uds)
    else:
        run_app(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
