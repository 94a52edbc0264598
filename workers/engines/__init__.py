"""The worker engines, one module each, all behind ``workers.engines.interface.Engine``.

``load`` imports only the chosen engine's module: the vLLM engine needs vLLM, which lives in
its own environment, and the simulated engine needs no model at all.
"""
