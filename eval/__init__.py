"""Evaluator and configuration search for toolkit recipes (imports :mod:`toolkit`; the toolkit never imports this).

* :mod:`eval.evaluate` — ``evaluate(recipe, ...)``: perplexity, acceptance, memory, latency, fidelity and in-process
  baselines, written to ``results/<recipe-name>-<config-hash>/`` (``metrics.json``, ``report.md``, PNG plots).
* :mod:`eval.quality` — output quality vs the fp32 AR reference text: ROUGE-L (summarization prompts), exact match and
  first divergence (code prompts), through the HF ``evaluate`` modules of :mod:`toolkit.metrics`.
* :mod:`eval.search` — multi-objective Optuna search per scenario (``short`` / ``long`` / ``memory``).
* :mod:`eval.scenarios` — the scenario definitions (objectives and constraints).
"""
