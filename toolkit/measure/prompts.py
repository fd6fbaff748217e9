"""Versioned prompt suites of real text, one YAML file per scenario in ``recipes/prompts/``.

A suite lists prompts of three kinds:

* ``chat`` — instruction messages, rendered with the model's chat template;
* ``summarize`` — a real passage read from a local text (license texts, Python's LICENSE) wrapped in an instruction;
* ``code`` — the opening lines of a real Python standard-library module, continued as plain text.

Passages are read at run time from files every Python install (or Debian) has, so nothing is downloaded; the suite
file pins which lines, and its ``version`` changes whenever a prompt does, so results stay comparable. An entry may
carry a ``reference``: an answer written by a person for that prompt, which quality measures score generated text
against (ROUGE-L, Lin 2004) instead of against another recipe's output.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.checks import check_choice, check_int, check_str_list
from toolkit.errors import ConfigError

KINDS = ("chat", "summarize", "code", "text")
#: keys of a suite entry and of its ``source`` mapping
ENTRY_KEYS = ("id", "kind", "messages", "source", "template", "reference")
SOURCE_KEYS = ("files", "start_line", "num_lines")
SUITE_KEYS = ("name", "version", "description", "prompts")
MAX_LINES = 100_000


@dataclass
class Prompt:
    """One prompt: ``prompt`` is a string (plain text) or a list of chat messages; ``reference`` a written answer
    to score generated text against (``None``: the suite gives none)."""

    id: str
    kind: str
    prompt: str | list[dict]
    reference: str | None = None


def _resolve(candidate: str) -> Path:
    """``stdlib:json/decoder.py`` -> a path in the running interpreter's standard library; else a plain path."""
    if candidate.startswith("stdlib:"):
        return Path(os.path.dirname(os.__file__)) / candidate.split(":", 1)[1]
    return Path(candidate).expanduser()


def _mapping(value: object, field: str, keys: tuple[str, ...]) -> dict:
    """``value`` as a mapping whose keys are all in ``keys``; raises :class:`ConfigError` naming the field."""
    if not isinstance(value, dict):
        raise ConfigError(field, f"must be a mapping with keys {', '.join(keys)}, got {value!r}")
    for key in value:
        if key not in keys:
            raise ConfigError(f"{field}.{key}", "unknown field", keys)
    return value


def read_passage(source: dict, field: str) -> str:
    """Lines ``[start_line, start_line + num_lines)`` (1-based) of the first existing file in ``source['files']``.

    Raises:
        ConfigError: ``source`` is not a mapping of ``files`` (a list of paths), ``start_line`` (>= 1) and
            ``num_lines`` (>= 1); no candidate file exists; or the file ends before ``start_line``.
    """
    source = _mapping(source, field, SOURCE_KEYS)
    files = check_str_list(f"{field}.files", source.get("files"), "file paths ('stdlib:NAME' for the standard library)")
    start = source.get("start_line", 1)
    count = source.get("num_lines", 40)
    check_int(f"{field}.start_line", start, low=1, high=10 * MAX_LINES)
    check_int(f"{field}.num_lines", count, low=1, high=MAX_LINES)
    for candidate in files:
        path = _resolve(candidate)
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            chosen = lines[start - 1: start - 1 + count]
            if not chosen:
                raise ConfigError(f"{field}.start_line", f"{path} has only {len(lines)} lines, got {start}")
            return "\n".join(chosen).strip("\n")
    raise ConfigError(f"{field}.files", f"none of these files exists on this machine: {files}")


def _build(entry: object, field: str) -> Prompt:
    entry = _mapping(entry, field, ENTRY_KEYS)
    kind = entry.get("kind")
    check_choice(f"{field}.kind", kind, KINDS)
    pid = entry.get("id", field)
    if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not str(pid):
        raise ConfigError(f"{field}.id", f"must be a non-empty string, got {pid!r}")
    pid = str(pid)
    reference = entry.get("reference")
    if reference is not None and not (isinstance(reference, str) and reference.strip()):
        raise ConfigError(f"{field}.reference", f"must be a non-empty string (a written answer), got {reference!r}")
    return dataclasses.replace(_prompt(entry, field, kind, pid), reference=reference)


def _prompt(entry: dict, field: str, kind: str, pid: str) -> Prompt:
    """The prompt text or messages of a checked entry."""
    if kind == "chat":
        messages = entry.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{field}.messages", "a chat prompt needs a non-empty list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"} or not all(
                    isinstance(v, str) for v in message.values()):
                raise ConfigError(f"{field}.messages[{i}]", f"must be {{role: ..., content: ...}} with string "
                                  f"values, got {message!r}")
        return Prompt(pid, kind, messages)
    passage = read_passage(entry["source"], f"{field}.source") if "source" in entry else ""
    template = entry.get("template", "{passage}")
    if not isinstance(template, str):
        raise ConfigError(f"{field}.template", f"must be a string, got {template!r}")
    try:
        text = template.format(passage=passage)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"{field}.template", f"may only use the placeholder {{passage}} (write {{{{ and }}}} for "
                          f"literal braces): {exc.__class__.__name__} {exc}") from None
    if not text:
        raise ConfigError(f"{field}.template", "makes an empty prompt")
    if kind == "summarize":
        return Prompt(pid, kind, [{"role": "user", "content": text}])
    return Prompt(pid, kind, text)


def plain_text(prompt: str | list[dict]) -> str:
    """``prompt`` as plain text for a base model (a tokenizer without a chat template): a string as it is; chat
    messages' contents, each followed by a blank line, so the model continues after the last one (the roles are
    dropped: a base model was never trained on them)."""
    if isinstance(prompt, str):
        return prompt
    return "".join(message["content"] + "\n\n" for message in prompt)


def load_suite(name_or_path: str) -> list[Prompt]:
    """Prompts of a shipped suite (``short``, ``long``, ``memory``: ``recipes/prompts/``), of a suite YAML file, or
    of a JSONL file of prompts (:func:`load_prompt_file`; ids ``prompt-N``, in file order).

    Raises:
        ConfigError: unknown suite name, a file that is not readable UTF-8 YAML, not a mapping or without a
            non-empty ``prompts`` list, or a malformed entry (the field is named: ``prompts[2].source.start_line``).
    """
    from toolkit.recipe import load_yaml_text, read_text
    from toolkit.resources import resolve

    if str(name_or_path).endswith(".jsonl"):
        return [Prompt(f"prompt-{i + 1}", "chat" if isinstance(p, list) else "text", p)
                for i, p in enumerate(load_prompt_file(name_or_path, "prompts"))]
    path = resolve(name_or_path, "prompts", "prompts")
    data = load_yaml_text(read_text(path, "prompts"), "prompts")
    if not isinstance(data, dict):
        raise ConfigError("prompts", f"{path} must hold a mapping with a 'prompts' list, got {type(data).__name__}")
    for key in data:
        if key not in SUITE_KEYS:
            raise ConfigError(f"prompts.{key}", f"unknown field of the suite file {path}", SUITE_KEYS)
    entries = data.get("prompts")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("prompts", f"{path} holds no 'prompts' list")
    prompts = [_build(entry, f"prompts[{i}]") for i, entry in enumerate(entries)]
    seen: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        if prompt.id in seen:
            raise ConfigError(f"prompts[{i}].id", f"{prompt.id!r} repeats prompts[{seen[prompt.id]}].id")
        seen[prompt.id] = i
    return prompts


def load_prompt_file(path: str | Path, field: str = "--prompts") -> list:
    """Prompts of a JSONL file: one per line, ``{"prompt": "text"}``, ``{"messages": [...]}`` or a JSON string.

    Raises:
        ConfigError: unreadable file, a line that is not JSON, or a line of another shape (the line is named).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"cannot read {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{field}:{number}", f"not JSON: {exc.msg}") from None
        if isinstance(item, dict) and isinstance(item.get("messages"), list):
            item = item["messages"]
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = item["prompt"]
        if not (isinstance(item, str) and item) and not (isinstance(item, list) and item):
            raise ConfigError(f"{field}:{number}", 'expected {"prompt": "text"}, {"messages": [...]} or a string')
        prompts.append(item)
    if not prompts:
        raise ConfigError(field, f"{path} holds no prompt")
    return prompts
