"""The workers behind the gateway: the fleet that holds them (fleet.py), one worker's handle
(handle.py), the supervisor of local worker processes (supervisor.py) and their output
(worker_output.py), the health and load probe (probe.py), the relay's HTTP client to a worker
(worker_http.py), the pure router (routing.py) and what is in flight on a worker (draft_mix.py)."""
