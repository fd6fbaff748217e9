"""Versioned prompt suites of real text, one YAML file per scenario in ``recipes/prompts/``.

A suite lists prompts of three kinds:

* ``chat`` — instruction messages, rendered with the model's chat template;
* ``summarize`` — a real passage read from a local text (license texts, Python's LICENSE) wrapped in an instruction;
* ``code`` — the opening lines of a real Python standard-library module, continued as plain text.

Passages are read at run time from files every Python install (or Debian) has, so nothing is downloaded; the suite
file pins which lines, and its ``version`` changes whenever a prompt does, so results stay comparable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from toolkit.errors import ConfigError

KINDS = ("chat", "summarize", "code", "text")


@dataclass
class Prompt:
    """One prompt: ``prompt`` is a string (plain text) or a list of chat messages."""

    id: str
    kind: str
    prompt: str | list[dict]


def _resolve(candidate: str) -> Path:
    """``stdlib:json/decoder.py`` -> a path in the running interpreter's standard library; else a plain path."""
    if candidate.startswith("stdlib:"):
        return Path(os.path.dirname(os.__file__)) / candidate.split(":", 1)[1]
    return Path(candidate).expanduser()


def read_passage(source: dict, field: str) -> str:
    """Lines ``[start_line, start_line + num_lines)`` (1-based) of the first existing file in ``source['files']``.

    Raises:
        ConfigError: no candidate file exists, or the line range is empty.
    """
    files = source.get("files") or []
    for candidate in files:
        path = _resolve(candidate)
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            start = int(source.get("start_line", 1)) - 1
            chosen = lines[start: start + int(source.get("num_lines", 40))]
            if not chosen:
                raise ConfigError(f"{field}.start_line", f"{path} has only {len(lines)} lines")
            return "\n".join(chosen).strip("\n")
    raise ConfigError(f"{field}.files", f"none of these files exists on this machine: {files}")


def _build(entry: dict, field: str) -> Prompt:
    kind = entry.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{field}.kind", f"unknown kind {kind!r}", KINDS)
    pid = entry.get("id") or field
    if kind == "chat":
        messages = entry.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{field}.messages", "a chat prompt needs a non-empty list of messages")
        return Prompt(pid, kind, messages)
    passage = read_passage(entry.get("source", {}), f"{field}.source") if "source" in entry else ""
    template = entry.get("template", "{passage}")
    text = template.format(passage=passage)
    if kind == "summarize":
        return Prompt(pid, kind, [{"role": "user", "content": text}])
    return Prompt(pid, kind, text)


def load_suite(name_or_path: str) -> list[Prompt]:
    """Prompts of a shipped suite (``short``, ``long``, ``memory``: ``recipes/prompts/``) or of a suite YAML file.

    Raises:
        ConfigError: unknown suite name, or a malformed entry (the field is named).
    """
    from toolkit.resources import resolve

    path = resolve(name_or_path, "prompts", "prompts")
    data = yaml.safe_load(path.read_text()) or {}
    entries = data.get("prompts")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("prompts", f"{path} holds no 'prompts' list")
    return [_build(entry, f"prompts[{i}]") for i, entry in enumerate(entries)]
