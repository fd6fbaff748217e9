"""Stage ``search``: the toolkit's configuration search (:func:`eval.search.run_search`, what ``toolkit search``
runs) on the device, for the three scenarios of the GPU issue (``short``, ``long``, ``memory``, their spaces in
``recipes/search/``, at the scenario lengths), each within an equal share of the time left, with the held-out
confirmation of the winner (a prompt suite no trial saw, the baselines timed afresh).

The target is the embedded model (the relayed GGUF, made ``source: embedded`` by
:func:`gpu_kit.carry.install_embedded`). On a GPU the space files' ``fp16`` weights (kept off for CPUs) are searched
too (``--enable target_precision.fp16``). The study, trials and found recipe go to a scratch folder; the stage's
result keeps, per scenario, the summary (winner, Pareto front, counts), the held-out numbers and the text of the found
recipe, so nothing but the kit's three files needs to come back. The dry run: the ``short`` scenario, one trial,
a few tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("short", "long", "memory")
#: the dry run's evaluation settings (one prompt, a few tokens, one repetition)
DRY_EVAL = {"num_prompts": 1, "max_new_tokens": 8, "repeats": 1, "warmup": 0, "ppl_tokens": 96, "ppl_window": 64,
            "ppl_stride": 32, "baselines": ["ar"]}


def _jsonable(value):
    """``value`` with paths as strings and anything else that JSON cannot hold as its ``str``."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def one_scenario(kit, scenario: str, timeout: float, out_dir: Path) -> dict:
    """``run_search`` of ``scenario`` within ``timeout`` seconds into ``out_dir``; the summary, and the found recipe's
    text (``found``) when one was written."""
    from eval.search import run_search

    options = {"enable": ["target_precision.fp16"]}
    if kit.dry_run:  # one trial, a few tokens, the held-out confirmation of the winner alone (no shipped recipes)
        import yaml

        space = yaml.safe_load((ROOT / "recipes" / "search" / f"{scenario}.yaml").read_text())
        space["heldout"]["compare"] = []
        options = {"trials": 1, "eval_overrides": DRY_EVAL, "space": space}
    summary = run_search(scenario, timeout=timeout, out=out_dir, progress=False, **options)
    result = {"summary": _jsonable(summary), "timeout_s": timeout}
    found = out_dir / f"{scenario}.yaml"
    if found.is_file():
        result["found"] = found.read_text()
    return result


def search(kit) -> dict:
    """Each scenario of :data:`SCENARIOS` (``short`` only in the dry run) in an equal share of the time left."""
    from toolkit.models.embedded import embedded_gguf_path

    if kit.embedded is None:
        raise RuntimeError("the embedded model was not relayed (bench/README.md): nothing to search on")
    embedded_gguf_path()  # raises when `source: embedded` does not resolve here
    scenarios = SCENARIOS[:1] if kit.dry_run else SCENARIOS
    out = {"scenarios": {}}
    root = Path(tempfile.mkdtemp(prefix="gpu-kit-search-"))
    for i, scenario in enumerate(scenarios):
        left = kit.time_left() - 20.0
        share = left / (len(scenarios) - i)
        if share < 60 or kit.out_of_time(f"search {scenario}"):
            out["scenarios"][scenario] = {"skipped": f"{max(share, 0):.0f} s left for it: too little for a trial"}
            continue
        try:
            out["scenarios"][scenario] = one_scenario(kit, scenario, min(share, 1750.0), root / scenario)
        except Exception as exc:  # noqa: BLE001 - one scenario failing must not stop the next
            out["scenarios"][scenario] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        kit.partial("search", out)
    return out
