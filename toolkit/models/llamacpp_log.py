"""llama.cpp's log, through Python's :mod:`logging` (logger ``toolkit.llamacpp``) at the level llama.cpp gave it.

llama-cpp-python 0.3.36 installs a log callback that maps ggml's levels by an old numbering of the enum (NONE, INFO,
WARN, ERROR, DEBUG), while the llama.cpp it builds numbers them NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
(``ggml.h``, ``enum ggml_log_level``). With ``verbose=False`` its warnings therefore reach stderr as if they were errors
and its errors are dropped as debug output. :func:`route` replaces that callback, once per process: errors are logged
as errors, warnings as warnings, the rest at debug level; a ``CONT`` piece continues the line before it, and a line is
logged whole once its newline arrives.

One warning is ours by design and logged at debug level: a context holds :data:`~toolkit.models.llamacpp.
VERIFY_HEADROOM` positions past the model's training context (the last verify forward of a request that fills the
context writes its draft tokens there; they are never kept), which llama.cpp reports as "n_ctx_seq (...) >
n_ctx_train (...) -- possible training context overflow".
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("toolkit.llamacpp")

#: ggml's ``enum ggml_log_level`` of the pinned llama.cpp -> :mod:`logging` levels (5, ``CONT``, continues a line)
LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
CONT = 5
#: a warning the toolkit's own context size causes (see the module docstring): logged at debug level
OURS = "> n_ctx_train"

_state = {"level": logging.DEBUG, "pending": "", "callback": None}


def emit(level: int, text: str) -> None:
    """Take one piece of llama.cpp's log (its ggml ``level`` and ``text``) and log every line it completes."""
    if level != CONT:
        if _state["pending"]:  # a new message ends an unterminated one
            _flush(_state["pending"])
            _state["pending"] = ""
        _state["level"] = LEVELS.get(level, logging.DEBUG)
    lines = (_state["pending"] + text).split("\n")
    _state["pending"] = lines.pop()  # what follows the last newline waits for the rest of its line
    for line in lines:
        _flush(line)


def _flush(line: str) -> None:
    if not line.strip():
        return
    level = _state["level"]
    if level == logging.WARNING and OURS in line:
        level = logging.DEBUG
    log.log(level, "%s", line.rstrip())


def route(llama_cpp) -> None:
    """Install the callback on the ``llama_cpp`` module's library (after ``llama_cpp`` itself was imported, which
    installs its own); idempotent. The callback object is kept for the life of the process (ctypes frees a callback
    that nothing references). Called by :func:`toolkit.models.llamacpp.require`, the library's one way to
    ``llama_cpp``; the baseline engines' worker (:mod:`toolkit.measure.engine_worker`) imports nothing from the
    toolkit and keeps llama-cpp-python's own callback (its contexts stay within the training context, so it prints
    nothing of ours)."""
    if _state["callback"] is not None:
        return

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data) -> None:
        emit(int(level), text.decode("utf-8", errors="replace"))

    _state["callback"] = callback
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
