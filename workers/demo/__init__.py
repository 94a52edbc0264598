"""The demo draft/target pair's trainer (``train.py``, ``make models``) and its corpus
(``corpus.py``): the small real models the tests and benches serve with the embedded engine.
"""
