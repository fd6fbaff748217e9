"""Fit the lookup drafter's prior acceptance estimate (``prior_bias``, ``prior_slope``, ``prior_share`` of
:class:`toolkit.speculative.drafters.lookup.LookupConfig`) on the target's own greedy outputs.

    PYTHONPATH=. .venv/bin/python bench/fit_lookup_prior.py [--precision fp32] [--out bench/results/lookup_prior.json]

1. The target (embedded SmolLM2, ``--precision``) answers every prompt of the training suites (``short`` and
   ``repeat``; 128 new tokens, greedy) and of the evaluation suites (``short-heldout`` and ``bench/prompts/unseen``).
2. At every position of every answer the lookup drafter (no memory across requests) proposes up to 8 tokens; each
   drafted token whose predecessors were all right is one sample: its features (``ln`` match length, the share of the
   equally long matches that agree with it) and whether it equals the target's next token.
3. A logistic regression (numpy, L2 1e-3) on the training samples gives the three coefficients; the log-loss of the
   fitted and of the shipped estimate on the evaluation samples is printed next to a match-length-only fit.

The decode loop calibrates these estimates online (:class:`toolkit.speculative.verify_length.Calibrator`), so the
prior matters most for the first rounds of a generation.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toolkit  # noqa: E402
from toolkit.io import atomic_write_json  # noqa: E402
from toolkit.measure.prompts import load_suite  # noqa: E402
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec  # noqa: E402
from toolkit.speculative.drafters import LookupConfig, LookupDrafter  # noqa: E402

TRAIN = ["short", "repeat"]
EVAL = ["short-heldout", str(ROOT / "bench/prompts/unseen.yaml")]


def answers(precision: str, suites: list[str]) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, greedy answer ids)`` of every prompt of ``suites``."""
    recipe = Recipe(name="fit-prior", target=ModelSpec(precision=precision), draft=None,
                    spec=SpeculationSpec(drafter="none"), generation=GenerationSpec(max_new_tokens=128))
    generator = toolkit.build(recipe)
    out = []
    for suite in suites:
        for prompt in load_suite(suite):
            result = generator.generate(prompt.prompt)
            out.append((result.prompt_ids, result.token_ids))
    return out


def samples(pairs: list[tuple[list[int], list[int]]], k: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Features ``(n, 3)`` = [ln match, share, 1] and outcomes ``(n,)`` of every conditionally tested draft token."""
    X, y = [], []
    for prompt, answer in pairs:
        drafter = LookupDrafter(max_cached_requests=0)
        drafter.reset()
        sequence = prompt + answer[:1]
        for p in range(1, len(answer) - 1):
            tokens, _ = drafter.propose(torch.tensor([sequence]), min(k, len(answer) - p))
            for token, (match, share), truth in zip(tokens[0].tolist(), drafter.match_features(), answer[p:]):
                X.append([math.log(match), share, 1.0])
                y.append(float(token == truth))
                if token != truth:
                    break
            sequence.append(answer[p])
    return np.array(X), np.array(y)


def fit(X: np.ndarray, y: np.ndarray, l2: float = 1e-3, iterations: int = 5000, rate: float = 0.5) -> np.ndarray:
    w = np.zeros(X.shape[1])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-(X @ w)))
        w -= rate * (X.T @ (p - y) / len(y) + l2 * w)
    return w


def log_loss(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    p = np.clip(1 / (1 + np.exp(-(X @ w))), 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/lookup_prior.json")
    args = parser.parse_args()
    Xtr, ytr = samples(answers(args.precision, TRAIN))
    Xev, yev = samples(answers(args.precision, EVAL))
    w = fit(Xtr, ytr)
    w_match = fit(Xtr[:, [0, 2]], ytr)
    shipped = LookupConfig()
    w_shipped = np.array([shipped.prior_slope, shipped.prior_share, shipped.prior_bias])
    result = {"precision": args.precision, "train_suites": TRAIN, "eval_suites": EVAL,
              "samples": {"train": len(ytr), "eval": len(yev)},
              "fitted": {"prior_slope": round(float(w[0]), 2), "prior_share": round(float(w[1]), 2),
                         "prior_bias": round(float(w[2]), 2)},
              "eval_log_loss": {"fitted": log_loss(Xev, yev, w), "shipped": log_loss(Xev, yev, w_shipped),
                                "match_length_only": log_loss(Xev[:, [0, 2]], yev, w_match)}}
    atomic_write_json(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
