"""Measurement: the timing harness, the HF baselines, timing summaries and the prompt suites.

The layer between the library (``toolkit``: models, quant, kv, speculative, session) and the evaluator / search /
CLI (``eval``, ``toolkit_cli``): it imports the library and is imported by them, never the other way round
(``tests/test_layout.py`` checks the direction).
"""
