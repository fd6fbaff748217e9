"""Head-importance calibration for the head-aware policy, measured on real local text.

Measure (per layer, per KV head): the *long-range attention mass* — the average, over query positions ``i``, of the
attention probability a head puts on keys outside the sinks and outside its own local window, i.e. on keys
``sink_tokens <= j <= i - local_window``. It is exactly the mass a head would lose if it were given a
StreamingLLM-style (sinks + recent) cache. DuoAttention (Xiao et al., 2024) separates "retrieval heads" from
"streaming heads" by how much a head's output suffers under that streaming pattern (with learned gates);
RazorAttention (Tang et al., 2024) and HeadKV (Fu et al., 2024) likewise score heads by their attention to distant
tokens. We measure it directly, without training. Query heads of one KV group are averaged (GQA), and scores are
divided by the model-wide maximum, so importance lies in [0, 1].

Text: ``datasets.load_dataset("text", data_files=...)`` over local files (default: the Apache-2.0 license text and
Python standard-library sources; the GPL-3 text is left out so that it can serve as held-out evaluation text).
Token ids come from the model's tokenizer when it can be loaded locally from ``config._name_or_path``, else from
the UTF-8 bytes of the text modulo the vocabulary (random-weight test models).

Results are stored as JSON in ``toolkit.resources.cache_dir() / "kv-calibration"``, written atomically and keyed by
the model (type, shape, a hash of weights) and the measurement settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from pathlib import Path

import torch

from toolkit.io import atomic_write_json

log = logging.getLogger(__name__)
_CALIB_NAME = "toolkit_kv_calibrate"
_FORMAT = 1


def default_files() -> list[str]:
    """Apache-2.0 license text (if present) and three Python standard-library modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in (Path("/usr/share/common-licenses/Apache-2.0"),) if p.is_file()]
    files += [stdlib / name for name in ("textwrap.py", "argparse.py", "json/decoder.py") if (stdlib / name).is_file()]
    return [str(p) for p in files]


def calibration_ids(model, files: list[str], num_tokens: int) -> torch.Tensor:
    """``(1, num_tokens)`` token ids of the text of ``files`` (see the module docstring for the tokenization)."""
    from datasets import load_dataset

    text = "\n".join(load_dataset("text", data_files=files, split="train")["text"])
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path, local_files_only=True)
        ids = tokenizer(text[: num_tokens * 12]).input_ids
    except Exception:  # no local tokenizer (random-weight models): byte-level ids
        ids = None
    if ids is None or max(ids) >= vocab:
        ids = [b % vocab for b in text.encode()]
    if len(ids) < num_tokens:
        raise ValueError(f"calibration text has {len(ids)} tokens, {num_tokens} needed; add calibration_files")
    return torch.tensor([ids[:num_tokens]])


def long_range_mass(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, sink_tokens: int,
                    local_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's causal attention over a calibration prompt and each KV head's long-range attention mass.

    ``query`` ``(1, q_heads, n, head_dim)``, ``key`` / ``value`` ``(1, kv_heads, n, head_dim)`` (HF's attention
    interface). Returns ``(out (1, n, q_heads, head_dim), mass (kv_heads,))``: the attention output as HF's layers
    expect it, and the mean softmax mass queries put on keys past the sinks and outside their last ``local_window``
    positions (averaged over the queries that have such keys and over the query heads of each KV head's group). Every
    index is built on ``query``'s device (a CUDA model calibrates on CUDA)."""
    groups = query.shape[1] // key.shape[1]
    key_r, value_r = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    n = query.shape[-2]
    logits = (query.float() @ key_r.float().transpose(-1, -2)) * scaling
    positions = torch.arange(n, device=query.device)
    i, j = positions[:, None], positions[None, :]
    probs = logits.masked_fill(j > i, float("-inf")).softmax(-1)
    far = (j >= sink_tokens) & (j <= i - local_window)
    rows = far.any(-1)  # (n,): queries with keys that far
    mass = ((probs * far).sum(-1) * rows).sum(-1) / rows.sum()  # (b, q_heads): the mean over those queries
    out = probs.to(value.dtype) @ value_r
    return out.transpose(1, 2).contiguous(), mass.mean(0).view(-1, groups).mean(-1)


def measure_importance(model, input_ids: torch.Tensor, sink_tokens: int = 4, local_window: int = 64) -> torch.Tensor:
    """Long-range attention mass per head: ``(num_layers, num_kv_heads)`` in [0, 1] (see the module docstring)."""
    from transformers import AttentionInterface

    config = model.config.get_text_config(decoder=True)
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    scores: dict[int, torch.Tensor] = {}

    def observe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, scores[module.layer_idx] = long_range_mass(query, key, value, scaling, sink_tokens, local_window)
        return out, None

    AttentionInterface.register(_CALIB_NAME, observe)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CALIB_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    importance = torch.stack([scores[i] for i in range(config.num_hidden_layers)]).cpu()
    assert importance.shape[1] == n_kv
    return importance / importance.max().clamp_min(1e-12)


def model_key(model) -> str:
    """Stable identifier of ``model``: type, shape, the weight formats and a hash of samples of its plain weights.

    Quantized weights (torchao tensor subclasses, which support neither ``view`` nor ``flatten``) are not sampled;
    their formats (class and dtype) enter the hash, so a quantized model never shares an fp32 model's scores."""
    config = model.config.get_text_config(decoder=True)
    digest = hashlib.sha256()
    params = list(model.parameters())
    plain = [p for p in params if type(p.data) is torch.Tensor]
    formats = sorted({f"{type(p.data).__name__}:{p.dtype}" for p in params})
    digest.update(",".join(formats).encode())
    for param in (plain[0], plain[len(plain) // 2], plain[-1]) if plain else ():
        digest.update(param.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    name = Path(str(getattr(model.config, "_name_or_path", "") or config.model_type)).name or config.model_type
    return f"{config.model_type}-{name}-L{config.num_hidden_layers}-{digest.hexdigest()[:12]}"


def load_or_calibrate(model, files: list[str] | None = None, num_tokens: int = 1024, sink_tokens: int = 4,
                      local_window: int = 64) -> torch.Tensor:
    """Head importance ``(num_layers, num_kv_heads)`` for ``model``: from the JSON cache, else measured and stored.

    Raises:
        ValueError: the calibration text is shorter than ``num_tokens``.
        ConfigError: ``files`` is one string instead of a list (field ``calibration_files``), or names a file that
            does not exist (``calibration_files[i]``).
    """
    from toolkit.checks import check_str_list
    from toolkit.errors import ConfigError
    from toolkit.resources import cache_dir

    if files:
        files = check_str_list("calibration_files", [str(f) if isinstance(f, Path) else f for f in files]
                               if not isinstance(files, str) else files, "text file paths")
    files = [str(f) for f in (files or default_files())]
    for i, f in enumerate(files):
        if not Path(f).expanduser().is_file():
            raise ConfigError(f"calibration_files[{i}]", f"{f} is not a file")
    settings = {"files": files, "num_tokens": num_tokens, "sink_tokens": sink_tokens,
                "local_window": local_window, "format": _FORMAT}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    path = cache_dir() / "kv-calibration" / f"{model_key(model)}-{tag}.json"
    if path.is_file():
        try:
            return torch.tensor(json.loads(path.read_text())["importance"])
        except (ValueError, KeyError):
            log.warning("ignoring unreadable calibration file %s", path)
    ids = calibration_ids(model, files, num_tokens)
    importance = measure_importance(model, ids, sink_tokens, local_window)
    atomic_write_json(path, {"model": model_key(model), "measure": "long-range attention mass (see "
                             "toolkit/kv/calibration.py)", "settings": settings,
                             "importance": importance.tolist()})
    log.info("head importance of %s written to %s", model_key(model), path)
    return importance
