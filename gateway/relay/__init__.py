"""The gateway's HTTP face: the aiohttp app (app.py), relaying a request to a worker and its
answer back (relay.py), resuming a stream on another worker (migration.py), draining on
shutdown (drain.py), polling the loop around requests (busy_poll.py), the OpenAPI document
(openapi.py) and /tokenize (tokenize.py)."""
