"""Model checkpoints (the demo pair, committed) and the tools that build the others at install time."""
