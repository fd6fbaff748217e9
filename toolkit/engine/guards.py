"""Compiled calls with dynamo's guard shortcut, for the engine's own forwards (the target's, a draft model's, an EAGLE
head's step).

Dynamo checks a compiled function's guards at every call: on a 2-core CPU the full check of the target's decode step
walked every weight of the model and cost 2-4 ms a step (10-20 % of it). Once a graph ran on a cache with every guard,
:func:`call_compiled` evaluates only the guards that tell the compiled graphs apart (``skip_guard_eval_unsafe``).
Every input of these calls is made by the engine itself, so the skipped guards (weights, dtypes, the model's
attributes) cannot have changed; a call that would need a new graph raises instead of running a wrong one, and is
retried with every guard. ``TOOLKIT_FULL_GUARDS=1`` turns the shortcut off. The compiled code is shared by every
forward of the process, and the graphs of another model (another dtype) differ from this one's only in guards the
shortcut skips: so the first call of a graph on a new cache runs every guard.

Dynamo keeps a tensor's metadata and aliasing checks in the shortcut for every tensor that is not an
``nn.Parameter``: weights the engine reads (a GGUF's int4 planes, :class:`~toolkit.quant.int4_linear.PackedInt4Linear`)
are frozen parameters, not buffers, for that reason (the guard lookup of a native int4 decode step: 1.0-1.3 ms as
buffers, 0.17-0.21 ms as parameters, of a ~10 ms step).
"""

from __future__ import annotations

import os

import torch


def skip_guards_default() -> bool:
    """Whether compiled calls may skip dynamo's full guard check once a graph ran with it (``TOOLKIT_FULL_GUARDS=1``
    turns the shortcut off; see the module docstring)."""
    return os.environ.get("TOOLKIT_FULL_GUARDS", "") in ("", "0")


def call_compiled(compiled, args: tuple, full_guards: bool):
    """``compiled(*args)``; unless ``full_guards``, evaluating only the guards that tell its compiled graphs apart
    (``skip_guard_eval_unsafe``; a call that would need a new graph raises, and is retried with every guard)."""
    if full_guards:
        return compiled(*args)
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(*args)
    except RuntimeError as exc:
        if "Recompilation" not in str(exc):
            raise
        return compiled(*args)
