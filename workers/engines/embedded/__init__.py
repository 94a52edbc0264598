"""The embedded PyTorch engine: a Llama draft and target (``llama.py``, its ``config.py``),
their KV cache (``kv_cache.py``), sampling and verification (``sampling.py``), the row-invariant
CPU kernels (``kernels/``: ``rowgemm.py`` with ``rowgemm.c``; the GGUF's blocks in
``quant_blocks.h``, laid out by ``blocks.py``), a target served from those blocks (``quantized.py``),
the speculative engine itself (``engine.py``) on its compute thread (``runner.py``), the start-up
cost measurement (``measurement/``), the draft tree (``trees/``), and ``adapter.py``, the
``workers.engines.interface.Engine`` the worker serves. Imports torch; nothing outside
``workers/engines/`` and the worker's start-up imports it.
"""
