"""The simulated GPU engine: a step-time roofline and an acceptance model (``roofline.py``, pure,
shared with ``bench.policy``'s virtual-time fleet) behind the ``workers.engines.interface.Engine``
a sim worker serves (``engine.py``). Its configuration, which the gateway validates, is
``workers/api/sim_config.py``.
"""
