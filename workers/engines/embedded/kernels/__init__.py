"""The CPU kernels of the embedded engine: rowgemm.c (and its thread pool, rowgemm_pool.h, and the
GGUF block kernels, quant_blocks.h), compiled at first use and loaded by rowgemm.py; blocks.py lays
the GGUF's Q4_1 and Q8_0 blocks out for them."""
