"""The EAGLE-3 method: the head (head.py) and its part of the engine's step (step.py)."""
