"""The engine-neutral cost model: what a step costs by batch depth and K (``cost_report.py``, fed
by the policy's rules in ``policies.cost``), and the on-disk cache of start-up measurements
(``cache.py``). No torch: the embedded engine measures its own costs
(``workers/engines/embedded/measurement/measure.py``); the sim and vLLM engines derive theirs.
"""
