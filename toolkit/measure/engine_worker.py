"""A CPU engine a user would pick instead of this toolkit, served in its own process: llama.cpp or OpenVINO.

Run by :mod:`toolkit.measure.engines` with the engines' own interpreter (``.venv-engines``: optimum-intel pins an
older transformers than the toolkit's, so the engines cannot share its environment). This file therefore imports
nothing from the toolkit — only the standard library, numpy and the engine's package.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout (everything the engines print goes
to stderr). Requests:

* ``{"op": "generate", "input_ids": [...], "max_new_tokens": N, "eos_token_ids": [...]}`` — greedy decoding;
  reply ``{"token_ids": [...], "ttft_ms": ..., "total_ms": ...}``, timed inside this process (the pipe is not
  counted against the engine).
* ``{"op": "score", "input_ids": [...]}`` — one teacher-forced forward; reply ``{"nll": [...], "argmax": [...]}``
  for positions ``1 .. n-1`` (negative log-likelihood in nats of each next token, the engine's top-1 before it).
* ``{"op": "info"}`` — ``{"engine": ..., "version": ..., "weight_bytes": ..., "threads": ...}``.
* ``{"op": "verify_curve", "input_ids": [...], "widths": [...], "repeats": R}`` (llama.cpp only): llama.cpp as a
  *verify engine* — after the ``input_ids`` context, the median ms of one ``eval`` of ``n`` tokens with logits for
  all ``n`` positions (what a verify forward needs), each rolled back exactly afterwards (``kv_cache_seq_rm`` of the
  ``n`` positions, the length moved back); reply ``{"ms": {n: ...}, "rollback_exact": bool}`` (every repeated
  forward after a rollback gave bit-identical logits).
* ``{"op": "export", "source": HF_DIR, "out": DIR, "group_size": 32}`` (OpenVINO only, before serving): int4
  asymmetric weight compression of every linear layer by NNCF through optimum-intel, written to ``DIR``.

Engines:

* ``llamacpp`` (llama-cpp-python): the GGUF file as it is; ``--lookup-tokens N`` adds llama.cpp's prompt-lookup
  drafter (``LlamaPromptLookupDecoding``, ``max_ngram_size`` = ``--max-ngram``). The KV cache is reset before every
  request, so no request reuses an earlier one's prompt prefix.
* ``openvino`` (optimum-intel ``OVModelForCausalLM``): an exported int4 model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

#: a context grown to a longer request is a multiple of this many positions
CONTEXT_STEP = 1024


def _log_softmax_rows(logits):
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def _score_from_logits(logits, ids: list[int]) -> dict:
    """``logits`` ``(n, vocab)`` for positions ``0 .. n-1`` -> NLL of ``ids[1:]`` and the argmax before each."""
    logp = _log_softmax_rows(logits[: len(ids) - 1])
    nll = [float(-logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    return {"nll": nll, "argmax": [int(i) for i in logp.argmax(axis=-1)]}


class LlamaCpp:
    """llama.cpp through llama-cpp-python: greedy (``temp = 0``: argmax), no repetition penalty."""

    def __init__(self, model: str, threads: int, lookup_tokens: int, max_ngram: int, n_ctx: int):
        self.path, self.threads, self.n_ctx = model, threads, n_ctx
        self.lookup = (lookup_tokens, max_ngram)
        self.llm = self._llama()
        self._scorer = None

    def _llama(self, scorer: bool = False):
        """A context of ``n_ctx`` positions on the model: the generator (with the prompt-lookup draft when asked) or,
        with ``scorer``, one keeping logits for every position (``logits_all``)."""
        from llama_cpp import Llama

        draft = None
        if self.lookup[0] and not scorer:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=self.lookup[1], num_pred_tokens=self.lookup[0])
        # with a draft, llama-cpp-python writes each evaluated position's logits at its row of `scores`, a buffer of
        # n_batch (512) rows unless logits_all: a longer prompt failed with "could not broadcast input array from
        # shape (...) into shape (0,)" (llama-cpp-python 0.3.36; its issue 657 is the same overflow), so the lookup
        # engine keeps every position's logits, as its users must
        # flash attention as llama.cpp's own CLI and server run on a CPU (-fa auto) and as the toolkit's llama.cpp
        # target does (toolkit.models.llamacpp.cache_kwargs): llama-cpp-python's default is off
        return Llama(model_path=self.path, n_ctx=self.n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                     draft_model=draft, logits_all=scorer or draft is not None, flash_attn=True, verbose=False)

    def _fit(self, positions: int) -> None:
        """Grow the context to hold ``positions`` (rounded up to a multiple of :data:`CONTEXT_STEP`): a request
        longer than ``--n-ctx`` is served, as the toolkit's own engine sizes its cache to the request (a 4k-token
        document with llama.cpp's default 2,048 failed before)."""
        if positions <= self.n_ctx:
            return
        self.n_ctx = -(-positions // CONTEXT_STEP) * CONTEXT_STEP
        self.llm, self._scorer = self._llama(), None

    def info(self) -> dict:
        import llama_cpp

        return {"engine": "llama.cpp", "version": llama_cpp.__version__, "weight_bytes": os.path.getsize(self.path),
                "threads": self.threads, "n_ctx": self.n_ctx}

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
        self._fit(len(ids) + max_new_tokens)
        self.llm.reset()  # no prefix reuse from the previous request
        out: list[int] = []
        start = time.perf_counter()
        first = None
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            first = first or time.perf_counter()
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        end = time.perf_counter()
        return {"token_ids": out, "ttft_ms": ((first or end) - start) * 1000, "total_ms": (end - start) * 1000}

    def _all_logits(self):
        if self._scorer is None:  # logits for every position need their own context (logits_all)
            self._scorer = self._llama(scorer=True)
        self._scorer.reset()
        return self._scorer

    def score(self, ids: list[int]) -> dict:
        self._fit(len(ids))
        scorer = self._all_logits()
        scorer.eval(ids)
        return _score_from_logits(scorer.scores[: len(ids)], ids)

    def verify_curve(self, ids: list[int], widths: list[int], repeats: int) -> dict:
        import statistics

        self._fit(len(ids) + max(widths))
        llm = self._all_logits()
        llm.eval(ids)
        import numpy as np

        times: dict[int, list[float]] = {n: [] for n in widths}
        first: dict[int, object] = {}
        exact = True
        for rep in range(repeats + 1):  # repetition 0 warms up and keeps the logits every later one must reproduce
            for n in widths:
                start = time.perf_counter()
                llm.eval(ids[:n])
                elapsed = (time.perf_counter() - start) * 1000
                logits = np.array(llm.scores[llm.n_tokens - n: llm.n_tokens])
                if rep:
                    times[n].append(elapsed)
                    exact = exact and bool(np.array_equal(logits, first[n]))
                else:
                    first[n] = logits
                llm.n_tokens -= n  # the rollback: the positions leave the KV cache, the length moves back
                llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        return {"ms": {n: statistics.median(v) for n, v in times.items()}, "rollback_exact": exact}


class OpenVINO:
    """OpenVINO through optimum-intel: ``OVModelForCausalLM.generate`` with greedy search, latency hint."""

    def __init__(self, model: str, threads: int):
        from optimum.intel import OVModelForCausalLM

        self.path, self.threads = model, threads
        config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
        self.model = OVModelForCausalLM.from_pretrained(model, ov_config=config, compile=True)

    def info(self) -> dict:
        import openvino

        size = sum(p.stat().st_size for p in Path(self.path).glob("*.bin"))
        return {"engine": "OpenVINO", "version": openvino.__version__, "weight_bytes": size, "threads": self.threads}

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
        import torch
        from transformers.generation.streamers import BaseStreamer

        marks: list[float] = []

        class First(BaseStreamer):
            def put(self, value):
                marks.append(time.perf_counter())

            def end(self):
                pass

        x = torch.tensor([ids])
        start = time.perf_counter()
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=sorted(eos) or None,
                                  pad_token_id=min(eos) if eos else 0, streamer=First())
        end = time.perf_counter()
        first = marks[1] if len(marks) > 1 else end  # put #1 is the prompt
        return {"token_ids": out[0, len(ids):].tolist(), "ttft_ms": (first - start) * 1000,
                "total_ms": (end - start) * 1000}

    def score(self, ids: list[int]) -> dict:
        import torch

        x = torch.tensor([ids])
        logits = self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0]
        return _score_from_logits(logits.float().numpy(), ids)


def export_openvino(source: str, out: str, group_size: int) -> dict:
    """int4 asymmetric, one scale + zero point per ``group_size`` weights, every linear layer (``ratio = 1``):
    the scheme of the GGUF's Q4_1. Written to a temporary sibling of ``out``, then renamed (never half-written)."""
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    tmp = Path(f"{out}.tmp-{os.getpid()}")
    quant = OVWeightQuantizationConfig(bits=4, sym=False, group_size=group_size, ratio=1.0)
    model = OVModelForCausalLM.from_pretrained(source, export=True, quantization_config=quant, compile=False)
    model.save_pretrained(tmp)
    os.replace(tmp, out)
    return {"out": out}


def _engine(args):
    if args.engine == "llamacpp":
        return LlamaCpp(args.model, args.threads, args.lookup_tokens, args.max_ngram, args.n_ctx)
    return OpenVINO(args.model, args.threads)


def serve(args, replies) -> None:
    engine = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "export":
                reply = export_openvino(request["source"], request["out"], int(request.get("group_size", 32)))
            else:
                engine = engine or _engine(args)
                if op == "info":
                    reply = engine.info()
                elif op == "score":
                    reply = engine.score(request["input_ids"])
                elif op == "verify_curve":
                    reply = engine.verify_curve(request["input_ids"], request["widths"], int(request["repeats"]))
                elif op == "generate":
                    reply = engine.generate(request["input_ids"], int(request["max_new_tokens"]),
                                            set(request.get("eos_token_ids") or []))
                else:
                    reply = {"error": f"op: unknown {op!r} (allowed: generate, score, verify_curve, info, export)"}
        except Exception as exc:  # noqa: BLE001 (reported to the caller, which raises it naming the engine)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("llamacpp", "openvino"), required=True)
    parser.add_argument("--model", default="", help="the GGUF file (llamacpp) or exported directory (openvino)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookup-tokens", type=int, default=0, help="llama.cpp prompt lookup: tokens per draft")
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args(argv)
    replies = os.fdopen(os.dup(1), "w")  # replies only; anything the engines print goes to stderr
    os.dup2(2, 1)
    serve(args, replies)


if __name__ == "__main__":
    main()
