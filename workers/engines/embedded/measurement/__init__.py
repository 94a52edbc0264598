"""What the embedded engine measures about itself: the start-up check that verification is
bit-identical and the cost of its steps (measure.py), with shared helpers (common.py) and the
chain (steps.py) and tree (trees.py) timings."""
