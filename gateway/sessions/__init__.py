"""Where the gateway keeps its sessions: the in-process session table (table.py), the store that
shares sessions between replicas (store.py), and its Redis client (redis_resp.py)."""
