"""The run's settings and shared state (:class:`Kit`): device, dtype, sizes of the full run or the dry run, built
models, the tokenizer, the relayed embedded model, the results so far and the time budget."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_kit import carry, shapes

#: the full run on a GPU (<= 8 minutes on an H100), a real shape on a CPU (``--device cpu``: the 0.5B shape, shorter
#: curves; <= 8 minutes on 2 cores) and the dry run (the CPU, tiny models, seconds)
#: ``speed_shapes`` / ``batch_sizes``: the verify curves and speeds measured first (the issue's targets: a >= 1B
#: shape at B = 1 and 8); ``more_verify``: curves measured last, in the time left (``verify_cost_more``)
FULL = {"speed_shapes": ["llama-3.2-1b"], "draft_shape": "draft-68m", "batch_sizes": [1, 8],
        "more_verify": {"llama-3.2-1b": [32], "qwen2.5-0.5b": [1, 8, 32], "llama-3.1-8b": [1, 8]},
        "widths": [1, 2, 4, 8, 16, 32, 64], "context": 512, "new_tokens": 64,
        "prompt_tokens": 128, "num_prompts": 3, "repeats": 1, "timing_repeats": 5, "sampling_draws": 1500}
CPU = {"speed_shapes": ["qwen2.5-0.5b"], "draft_shape": "draft-68m", "batch_sizes": [1, 4], "more_verify": {},
       "widths": [1, 2, 4, 8, 16], "context": 128, "new_tokens": 32, "prompt_tokens": 64, "num_prompts": 2,
       "repeats": 1, "timing_repeats": 3, "sampling_draws": 500}
DRY = {"speed_shapes": ["tiny"], "draft_shape": "tiny-draft", "batch_sizes": [1, 2], "more_verify": {"tiny": [3]},
       "widths": [1, 2, 4],
       "context": 16, "new_tokens": 10, "prompt_tokens": 20, "num_prompts": 1, "repeats": 1, "timing_repeats": 2,
       "sampling_draws": 200}


class StageSkipped(Exception):
    """Raised by a stage that cannot run on this machine (the message says why): recorded as ``skipped``."""


@dataclass
class Kit:
    """One run of the kit. ``budget_s``: seconds after which stages that have not started are skipped;
    ``stage_caps``: ``{stage: seconds}`` after which that stage starts no more rows (the time left goes to the next)."""

    device: torch.device
    dtype: torch.dtype
    dry_run: bool
    carry_dir: Path
    budget_s: float
    compile_backend: str
    compile_mode: str | None
    log: object = print
    out_dir: Path | None = None
    args: dict = field(default_factory=dict)
    stage_caps: dict = field(default_factory=dict)
    stage: str | None = None
    stage_started: float = 0.0
    results: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _models: dict = field(default_factory=dict)
    _forwards: dict = field(default_factory=dict)

    def __post_init__(self):
        profile = DRY if self.dry_run else FULL if self.device.type == "cuda" else CPU
        for key, value in profile.items():
            setattr(self, key, value)
        self.tokenizer = shapes.tokenizer(self.carry_dir)
        if self.tokenizer is None and (self.carry_dir / "gguf" / carry.MANIFEST).is_file():
            real = self.embedded  # the relayed GGUF holds the tokenizer (None until every part has arrived)
            self.tokenizer = real[1] if real is not None else None

    # ------------------------------------------------------------------------------------------------ time
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self, what: str) -> bool:
        """True (and one log line) once the budget, or the running stage's cap, is spent: the caller skips
        ``what``."""
        if self.time_left() > 0:
            return False
        cap = self.stage_caps.get(self.stage)
        spent = f"stage {self.stage}'s {cap:.0f} s cap" if self.elapsed() < self.budget_s else \
            f"the {self.budget_s:.0f} s budget"
        self.log(f"skip {what}: {spent} is spent")
        return True

    def time_left(self) -> float:
        """Seconds left to the running stage: the budget's, or its cap's where that comes first."""
        left = self.budget_s - self.elapsed()
        cap = self.stage_caps.get(self.stage)
        if cap is not None:
            left = min(left, cap - (time.perf_counter() - self.stage_started))
        return left

    def begin_stage(self, name: str) -> None:
        """Start the clock of stage ``name`` (its cap in :attr:`stage_caps`, if any, counts from here)."""
        self.stage, self.stage_started = name, time.perf_counter()

    def row(self, what: str, fn, *args) -> dict:
        """``fn(*args)``'s row (a dict), or ``{"error"}`` when it raises (one row failing must not stop the
        others), with its ``seconds`` (build, compile, warm-up and timing included) and one log line: a call cut by
        its timeout still says where the time went."""
        began = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded, the caller goes on with the next row
            out = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        out["seconds"] = time.perf_counter() - began
        self.log(f"{what}: {out.get('tok_s', 0):.1f} tok/s, {out['seconds']:.1f} s in all")
        return out

    def partial(self, stage: str, result) -> None:
        """Record ``stage``'s results so far (status ``running``) and save: a run killed mid-stage keeps them."""
        self.results[stage] = {"status": "running", "seconds": None, "result": result}
        self.save()

    def save(self) -> None:
        """Write ``gpu_bench.json`` and ``gpu_bench.md`` of the results so far into ``out_dir`` (atomically)."""
        if self.out_dir is None:
            return
        from gpu_kit.report import markdown
        from toolkit.io import atomic_write_json, atomic_write_text

        atomic_write_json(self.out_dir / "gpu_bench.json", {"args": self.args, "seconds": self.elapsed(),
                                                            "stages": self.results})
        atomic_write_text(self.out_dir / "gpu_bench.md", markdown(self.results))

    # ------------------------------------------------------------------------------------------------ models
    def model(self, name: str, dtype: torch.dtype, seed: int = 0):
        """The random-weight model of shape ``name`` on the device (built once per name, dtype and seed; other
        speed shapes are dropped first so one large model at a time holds device memory)."""
        key = (name, dtype, seed)
        if key not in self._models:
            large = {*self.speed_shapes, *self.more_verify}
            if name in large:
                for other in [k for k in self._models if k[0] in large]:
                    self.forget(self._models.pop(other))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            began = time.perf_counter()
            self._models[key] = shapes.build(name, self.device, dtype, seed)
            self.log(f"built {name} ({shapes.SHAPES[name].params() / 1e6:.0f}M parameters, {dtype}) on "
                     f"{self.device} in {time.perf_counter() - began:.1f} s")
        return self._models[key]

    def compiled(self, model):
        """The compiled static engine of ``model`` the way the device runs it (CUDA graphs on a GPU; the dry run
        traces with the kit's backend), one per model: every stage reuses its graphs and its static cache."""
        from toolkit.engine.forward import TargetForward

        if id(model) not in self._forwards:
            self._forwards[id(model)] = TargetForward(model, compile=True, backend=self.compile_backend,
                                                      mode=self.compile_mode)
        return self._forwards[id(model)]

    def forget(self, model) -> None:
        """Drop the compiled forward (and its static cache) of ``model``; done before ``model`` is dropped, so an
        ``id`` is never reused while its forward is kept."""
        self._forwards.pop(id(model), None)

    @functools.cached_property
    def embedded(self):
        """``(model, tokenizer)`` of the real embedded SmolLM2 at fp32 on the device, from the relayed GGUF parts
        (``<carry>/gguf``) or, on a machine that has it, the toolkit's embedded source; ``None`` otherwise (said in
        the log). Loaded once."""
        from toolkit.models import load_model
        from toolkit.recipe import ModelSpec

        source = "embedded"
        parts = self.carry_dir / "gguf"
        if (parts / carry.MANIFEST).is_file():
            try:
                source = str(carry.join_parts(parts, Path("/tmp/gpu-kit-gguf")))
            except (FileNotFoundError, ValueError) as exc:
                self.log(f"skip the embedded model: {exc}")
                return None
            carry.install_embedded(Path(source))  # `source: embedded` resolves to it too (search, recipes)
        try:
            return load_model(ModelSpec(source=source, precision="fp32", device=self.device.type), "target")
        except Exception as exc:  # noqa: BLE001 - no embedded model here: the checks say so and go on
            self.log(f"skip the embedded model: {type(exc).__name__}: {str(exc)[:200]}")
            return None

    def head_step_ms(self, shape: str) -> float | None:
        """ms of one EAGLE head step on ``shape`` from the speed stage (the head's drafting per round / K)."""
        rows = self.results.get("speed", {}).get("result", {}).get(shape, {}).get("rows", {})
        draft = rows.get("ours EAGLE-1 head (K=3)", {}).get("round_draft")
        return draft / 3 if draft else None
