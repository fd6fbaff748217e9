"""How the command line reports errors: one line on stderr, never a traceback unless ``--debug`` asks for it.

Every command body runs under :func:`reported`, which sorts what escapes it into

* **user errors** — exit status 2, ``error: <message>``: anything the user can cause and fix from the message:
  :class:`~toolkit.errors.ToolkitError` (``ConfigError`` naming the field, ``ModelLoadError``,
  ``TokenizerMismatchError``), an ``OSError`` about a named file (a missing input, a permission, a full disk, an
  ``--out`` that is a file), a YAML error that escaped a loader, and running out of memory;
* **interrupts** — exit status 130, ``interrupted``;
* **internal errors** — exit status 1, ``internal error: <type>: <message> (a bug in the toolkit; rerun with
  --debug for the traceback)``: everything else is a bug, which the one line says, so that nobody mistakes it for a
  problem with their input.

``toolkit --debug COMMAND ...`` (or ``TOOLKIT_DEBUG=1``) re-raises instead, so the interpreter prints the
traceback. Errors of the command line itself (a bad option value, a missing argument, an unknown command) are one
line too, with exit status 2 (:class:`OneLineGroup`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator

import typer
from typer.core import TyperGroup

try:  # typer >= 0.26 vendors click; earlier versions use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_errors

from toolkit.errors import ToolkitError

#: click's "no arguments: show the help" signal (click >= 8.2; nothing to catch before)
_NO_ARGS_IS_HELP = getattr(click_errors, "NoArgsIsHelpError", ())

EXIT_USER = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130


class _State:
    debug: bool = False


STATE = _State()


def set_debug(debug: bool) -> None:
    """Turn tracebacks on (the ``--debug`` option of the ``toolkit`` callback)."""
    STATE.debug = bool(debug)


def debugging() -> bool:
    return STATE.debug or os.environ.get("TOOLKIT_DEBUG", "") not in ("", "0")


def _one_line(text: str) -> str:
    """``text`` on one line: the first line, with a hint when more followed."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] + (" [...]" if len(lines) > 1 else "")


def user_message(exc: BaseException) -> str | None:
    """The one-line message of an error the user caused, or ``None`` when ``exc`` is a bug."""
    if isinstance(exc, ToolkitError):
        return _one_line(str(exc))
    if isinstance(exc, OSError) and getattr(exc, "filename", None) is not None:
        reason = exc.strerror or exc.__class__.__name__
        return f"{exc.filename}: {reason}"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
        return (f"out of memory ({_one_line(str(exc)) or exc.__class__.__name__}); use a smaller model, precision, "
                "KV budget or max_new_tokens")
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        return None
    if isinstance(exc, yaml.YAMLError):
        return f"not valid YAML: {_one_line(str(exc))}"
    return None


def report(exc: BaseException) -> typer.Exit:
    """Print ``exc`` as one line on stderr and return the :class:`typer.Exit` to raise (see the module docstring)."""
    if isinstance(exc, KeyboardInterrupt):
        typer.secho("interrupted", fg="yellow", err=True)
        return typer.Exit(EXIT_INTERRUPTED)
    message = user_message(exc)
    if message is not None:
        typer.secho(f"error: {message}", fg="red", err=True)
        return typer.Exit(EXIT_USER)
    detail = _one_line(str(exc))
    typer.secho(f"internal error: {exc.__class__.__name__}{': ' + detail if detail else ''} (a bug in the toolkit; "
                "rerun with --debug for the traceback)", fg="red", err=True)
    return typer.Exit(EXIT_INTERNAL)


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Run a command body: errors become one line and an exit status (re-raised under ``--debug``)."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every error is reported; bugs are labelled as such
        if isinstance(exc, click_errors.ClickException) or debugging():
            raise
        raise report(exc) from None


def reported(command: Callable) -> Callable:
    """Decorator: run a typer command under :func:`reporting` (the signature typer reads is kept)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with reporting():
            return command(*args, **kwargs)

    return wrapper


class OneLineGroup(TyperGroup):
    """The ``toolkit`` group: click's own usage errors (an option value out of range, a missing argument, an
    unknown command) print ``error: <message> (see '<command> --help')`` on one line, exit status 2, instead of
    the usage panel. ``toolkit`` without arguments still prints the help; ``TOOLKIT_DEBUG=1`` keeps click's display.
    ``--debug`` lasts for one invocation (it is reset here, also when many run in one process)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        set_debug(False)  # --debug holds for this invocation only (tests run many in one process)
        try:
            return self._main(args, prog_name, complete_var, standalone_mode, **extra)
        finally:
            set_debug(False)

    def _main(self, args, prog_name, complete_var, standalone_mode: bool, **extra):
        if not standalone_mode or debugging():
            return super().main(args, prog_name, complete_var, standalone_mode=standalone_mode, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # the help, as typer shows it (rich has printed it already)
            from typer import core

            if not (getattr(core, "HAS_RICH", False) and getattr(self, "rich_markup_mode", None) is not None):
                exc.show()
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            command = getattr(getattr(exc, "ctx", None), "command_path", None)
            hint = f" (see '{command} --help')" if command else ""
            typer.secho(f"error: {_one_line(exc.format_message())}{hint}", fg="red", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.secho("aborted", fg="yellow", err=True)
            sys.exit(1)
        # non-standalone click returns the exit code of a typer.Exit, else the command's return value
        sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)
