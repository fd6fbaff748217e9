"""The layout tells the truth: imports point one way (interfaces -> measurement -> library), and the library stays
readable (no module over 400 lines, no function over 60).

* library — ``toolkit/`` except ``toolkit/measure/``: models, quant, kv, speculative, eagle, session, recipes, export;
* measurement — ``toolkit/measure/`` (harness, HF baselines, timing, prompt suites) and ``eval/`` (evaluator, search);
* interfaces — ``toolkit_cli/`` (every command).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_MODULE_LINES = 400
LIBRARY_FUNCTION_LINES = 60


def layer(module: str) -> int | None:
    """0 = library, 1 = measurement, 2 = interfaces (None: not ours)."""
    if module.startswith("toolkit_cli"):
        return 2
    if module == "eval" or module.startswith(("eval.", "toolkit.measure")):
        return 1
    if module == "toolkit" or module.startswith("toolkit."):
        return 0
    return None


def sources():
    for package in ("toolkit", "eval", "toolkit_cli"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield module.removesuffix(".__init__"), path


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_imports_point_from_interfaces_to_measurement_to_library():
    wrong = []
    for module, path in sources():
        here = layer(module)
        for target in imported(path):
            there = layer(target)
            if there is not None and there > here:
                wrong.append(f"{module} (layer {here}) imports {target} (layer {there})")
    assert not wrong, "\n".join(wrong)


def library_files():
    return [(m, p) for m, p in sources() if layer(m) == 0]


@pytest.mark.parametrize("module,path", library_files(), ids=lambda x: x if isinstance(x, str) else "")
def test_library_modules_and_functions_stay_small(module, path):
    source = path.read_text()
    assert source.count("\n") <= LIBRARY_MODULE_LINES, f"{module}: {source.count(chr(10))} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LIBRARY_FUNCTION_LINES]
    assert not long, f"{module}: {', '.join(long)}"


def test_no_drafter_name_is_compared_outside_the_registry():
    """Which drafter runs is asked of the registry (its config's class attributes), never spelled out."""
    names = ("draft_model", "ngram", "self", "suffix", "eagle", "lookup")
    offenders = []
    for module, path in sources():
        if module.startswith("toolkit.speculative.drafters"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                drafter = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "drafter"]
                if consts and drafter:
                    offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders
