"""The worker's HTTP server: the OpenAI routes and ``/specgate/*`` over any
``workers.engines.interface.Engine`` (``app.py``), chunk coalescing for streams
(``coalesce.py``) and the worker's Prometheus metrics (``metrics.py``). ``python -m workers``
(``workers/__main__.py``) starts it with the chosen engine.
"""
