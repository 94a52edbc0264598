"""Lookup proposers for the embedded engine: prompt lookup (``ngram.py``) and suffix matching
(``suffix.py``), and the step's glue (``proposer.py``). Their proposals are point masses
(``workers.engines.embedded.sampling.verify_point_mass``)."""
