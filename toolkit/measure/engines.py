"""The CPU engines a user would pick instead of this toolkit, as baseline rows of ``--compare`` when installed.

* ``llamacpp_ar`` — llama.cpp's plain autoregressive decoding on the **same GGUF** the embedded model comes from;
* ``llamacpp_lookup`` — the same with llama.cpp's prompt-lookup drafter (10 tokens, n-gram 3: the values of the
  HF prompt-lookup baseline ``prompt_lookup_10``);
* ``openvino_ar`` — OpenVINO through optimum-intel on the same model, weights compressed to int4 (asymmetric,
  groups of 32: Q4_1's scheme) by NNCF at export.

They run in their own interpreter (``scripts/install_engines.sh`` -> ``.venv-engines``; optimum-intel pins an older
transformers than the toolkit's) as a long-lived worker process (:mod:`toolkit.measure.engine_worker`) that loads
the model once and times each request itself; greedy decoding, the same prompts as token ids, the same
``max_new_tokens`` and EOS handling, the same thread count as the toolkit's torch.

Where the engines' interpreter is: ``$TOOLKIT_ENGINES_PYTHON`` (``off``: none, as in the test suite), else
``.venv-engines/bin/python`` in the working directory or the source checkout, else this interpreter when it has
llama-cpp-python (the ``[llamacpp]`` extra, ``make llamacpp``: the llama.cpp rows only). :func:`available` says which
engines it can import (none when it is absent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from toolkit.errors import ToolkitError
from toolkit.measure.harness import Call, Runner
from toolkit.recipe import GenerationSpec
from toolkit.resources import cache_dir
from toolkit.speculative.stats import GenerationStats

WORKER = Path(__file__).with_name("engine_worker.py")
_CHECKOUT = Path(__file__).resolve().parents[2]
#: OpenVINO int4 weight groups (Q4_1 has 32 weights per scale + minimum)
OPENVINO_GROUP_SIZE = 32
EXPORT_TIMEOUT_S = 1800.0


class EngineError(ToolkitError, RuntimeError):
    """An engine's worker failed: it could not start, or a request returned an error (the message names it)."""


@dataclass(frozen=True)
class Engine:
    """One engine row: the worker's ``--engine``, the module that must import, extra worker arguments."""

    name: str
    label: str
    engine: str
    module: str
    args: tuple = ()


ENGINES = {
    "llamacpp_ar": Engine("llamacpp_ar", "llama.cpp AR (same GGUF)", "llamacpp", "llama_cpp"),
    "llamacpp_lookup": Engine("llamacpp_lookup", "llama.cpp prompt lookup (10, same GGUF)", "llamacpp", "llama_cpp",
                              ("--lookup-tokens", "10", "--max-ngram", "3")),
    "openvino_ar": Engine("openvino_ar", "OpenVINO int4 AR (optimum-intel)", "openvino", "optimum.intel"),
}


def engines_python() -> str | None:
    """The engines' interpreter (see the module docstring), or ``None`` when there is none."""
    env = os.environ.get("TOOLKIT_ENGINES_PYTHON")
    if env:
        return None if env == "off" else env
    for root in (Path.cwd(), _CHECKOUT):
        candidate = root / ".venv-engines" / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    from toolkit.models import llamacpp

    if llamacpp.installed():  # the [llamacpp] extra in this environment (make llamacpp): the llama.cpp rows
        return sys.executable
    return None


#: what the probe prints after an importable llama_cpp: its build's ``llama_print_system_info``
_SYSTEM_INFO = "llama_cpp.system_info:"


@cache
def _importable(python: str, modules: tuple) -> frozenset:
    """The ``modules`` that ``python`` can import, less a llama.cpp build that would crash here
    (:func:`toolkit.models.llamacpp.amx_refusal`, which logs why)."""
    from toolkit.models.llamacpp import amx_refusal, log

    code = ("import importlib.util as u, sys\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n        print(m) if u.find_spec(m) else None\n"
            "    except ModuleNotFoundError:\n        pass\n"
            "if 'llama_cpp' in sys.argv[1:] and u.find_spec('llama_cpp'):\n"
            "    import llama_cpp\n"
            f"    print({_SYSTEM_INFO!r} + llama_cpp.llama_print_system_info().decode(errors='replace'))\n")
    try:
        out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=120,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    found = set()
    for line in out.stdout.splitlines():  # the system info comes last, after the module names
        if not line.startswith(_SYSTEM_INFO):
            found.add(line.strip())
        elif why := amx_refusal(line[len(_SYSTEM_INFO):]):
            log.warning("llama.cpp rows left out (%s): %s", python, why)
            found.discard("llama_cpp")
    return frozenset(found)


def available() -> list[str]:
    """Names of the :data:`ENGINES` whose package the engines' interpreter can import and run (``[]`` without
    one)."""
    python = engines_python()
    if python is None:
        return []
    found = _importable(python, tuple(sorted({e.module for e in ENGINES.values()})))
    return [name for name, engine in ENGINES.items() if engine.module in found]


class EngineProcess:
    """A worker process serving one engine (a context manager; :meth:`close` ends it).

    Raises:
        EngineError: the interpreter is missing, the worker died, or a request failed.
    """

    def __init__(self, engine: Engine, model: str | Path = "", threads: int | None = None,
                 python: str | None = None):
        self.engine, self.python = engine, python or engines_python()
        if self.python is None:
            raise EngineError(f"{engine.name}: no engines interpreter (run scripts/install_engines.sh or set "
                              "TOOLKIT_ENGINES_PYTHON)")
        threads = threads or torch.get_num_threads()
        cmd = [self.python, str(WORKER), "--engine", engine.engine, "--model", str(model), "--threads", str(threads),
               *engine.args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def request(self, op: str, **fields) -> dict:
        """Send one request (see :mod:`toolkit.measure.engine_worker`) and return its reply."""
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise EngineError(f"{self.engine.name}: the worker exited (code {self.proc.poll()}) during {op!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{self.engine.name}: {op} failed: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def engine_runner(process: EngineProcess, eos_ids: list[int]) -> Runner:
    """A :data:`~toolkit.measure.harness.Runner` sending each call to ``process`` (greedy only; ``gen.ignore_eos``
    as ours). Raises :class:`EngineError` for sampling settings: the engines' samplers are not ours."""

    def run(input_ids: torch.Tensor, gen: GenerationSpec) -> Call:
        if gen.do_sample:
            raise EngineError(f"{process.engine.name}: greedy only (generation.do_sample must be false)")
        eos = [] if gen.ignore_eos else list(eos_ids)
        reply = process.request("generate", input_ids=input_ids[0].tolist(), max_new_tokens=gen.max_new_tokens,
                                eos_token_ids=eos)
        ids = reply["token_ids"]
        stats = GenerationStats(prompt_tokens=int(input_ids.shape[1]), new_tokens=len(ids))
        stats.ttft_ms, stats.total_ms = reply["ttft_ms"], reply["total_ms"]
        stats.finish_reason = "length" if len(ids) >= gen.max_new_tokens else "eos"
        return Call(ids, stats)

    return run


def openvino_model(source: str | Path, python: str | None = None) -> Path:
    """The OpenVINO int4 export of the HF model directory ``source``, made once and cached under
    ``cache_dir()/openvino`` (an inter-process lock: two first uses export once; a failed export leaves nothing).

    Raises:
        EngineError: the export failed (the worker's message).
    """
    from filelock import FileLock

    out = cache_dir() / "openvino" / f"{Path(source).name}-int4-asym-g{OPENVINO_GROUP_SIZE}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock", timeout=EXPORT_TIMEOUT_S):
        if not (out / "openvino_model.xml").is_file():
            print(f"OpenVINO: exporting {source} to int4 (NNCF, groups of {OPENVINO_GROUP_SIZE}) -> {out}",
                  file=sys.stderr)
            with EngineProcess(ENGINES["openvino_ar"], python=python) as worker:
                worker.request("export", source=str(source), out=str(out), group_size=OPENVINO_GROUP_SIZE)
    return out
