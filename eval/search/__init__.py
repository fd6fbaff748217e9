"""Automated configuration search per scenario (Optuna, multi-objective, constrained), recipes as output.

    toolkit search --scenario short [--trials N] [--timeout S] [--out DIR] [--storage URL] [--workers N]

Every trial walks the scenario's space (``recipes/search/<scenario>.yaml``, conditional dimensions, see
:mod:`eval.space`), builds the recipe — a combination that makes no valid recipe is pruned with its reason before
any model loads, counted and never evaluated — runs the evaluator on it (fast settings from the space file) and
reports three objectives: throughput (max), perplexity (min), memory = weights + peak KV in MiB (min), plus the
scenario's constraints on each trial (optuna 5's ``Trial.set_constraint``, ``constraints_func`` before; feasible iff
every value <= 0; :mod:`eval.scenarios`).
The sampler is multi-objective TPE with constraints (multivariate, grouped for conditional spaces); a space small
enough for the trial budget is run as an exhaustive grid instead. The winner is the feasible trial best on the
scenario's primary objective (ties: lower perplexity); infeasible trials are never chosen.

Budget and resuming: ``--trials N`` is the number of *completed* trials the study should reach and ``--timeout S``
the wall-clock budget of this run (default ``timeout_s`` of the space file, <= 30 min on a 2-core CPU); the run stops
starting trials when one more trial plus the held-out confirmation would overrun it. A study is resumed by name
(``search-<scenario>``): re-running runs only the missing trials; finished ones are never repeated, and an identical
recipe is never evaluated twice (a finished one is reused, one running in another worker is skipped).

Held-out confirmation: the winner is measured again on a prompt suite no trial saw (``heldout.prompts`` in the
space file, e.g. ``recipes/prompts/short-heldout.yaml``), every baseline timed afresh in the same run, and so is each
shipped recipe named in ``heldout.compare``; the found recipe records the search and the held-out numbers.

Many workers, one study: ``--storage postgresql://...`` (or any Optuna RDB URL) and ``--workers N`` starts N worker
processes on the study (or start the same command on several machines with ``--no-finalize`` and the same
``--study-name``). Workers send heartbeats; the trial of a worker that dies is marked FAIL after the grace period
and re-queued once (``RetryFailedTrialCallback``).

Parts: :mod:`eval.search.study` (set-up, storage, workers, the run), :mod:`eval.search.trials` (one trial),
:mod:`eval.search.select` (typed trial rows, feasibility, the Pareto front, the winner), :mod:`eval.search.confirm`
(held-out confirmation, outputs) and :mod:`eval.search.report` (table, plot, the found recipe).

Outputs go to the working directory, ``--out`` (default ``./found``): ``<scenario>.yaml`` (the runnable winner, with
provenance and "why it won"; paths relative to the file), ``<scenario>/`` with ``pareto.png`` (every measured trial:
throughput vs memory, perplexity as colour, Pareto front and winner marked), ``pareto.md``, ``trials.json``, the
per-trial evaluation results and the default SQLite study ``study.db``.
"""

from eval.search.confirm import finalize
from eval.search.report import write_found_recipe
from eval.search.select import TrialRow, choose, is_feasible, pareto_front
from eval.search.storage import driver_url, safe_url
from eval.search.study import DEFAULT_OUT, STORAGE_ENV, run_search

__all__ = ["run_search", "finalize", "write_found_recipe", "TrialRow", "choose", "is_feasible", "pareto_front",
           "DEFAULT_OUT", "STORAGE_ENV", "driver_url", "safe_url"]
