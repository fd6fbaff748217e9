"""The ``toolkit`` command (``toolkit_cli.app``): above both the library and the evaluator, imported by neither."""

from toolkit_cli.app import app, main

__all__ = ["app", "main"]
