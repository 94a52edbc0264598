"""The CPU kernels of the embedded engine: rowgemm.c (and its thread pool, rowgemm_pool.h),
compiled at first use and loaded by rowgemm.py."""
