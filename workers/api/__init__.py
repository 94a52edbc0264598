"""The bottom layer that the gateway and the worker both import: the OpenAI request schema and
its fast parser, input limits, the wire protocol between gateway and workers (directive, step
reports, resume point, the error hierarchy), SSE/HTTP helpers, logs and bearer tokens.

Nothing here imports torch, an engine, the worker's server or the gateway
(tests/unit/test_architecture.py checks it); it may import ``policies``.
"""
