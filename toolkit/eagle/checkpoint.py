"""Head checkpoints in the published EAGLE layouts (config.json + model.safetensors, or pytorch_model.bin).

* EAGLE-1 / EAGLE-2 heads (e.g. ``yuhuili/EAGLE-Vicuna-7B-v1.3``, ``yuhuili/EAGLE-LLaMA2-Chat-7B``,
  ``yuhuili/EAGLE-llama2-chat-7B``; what vLLM's ``eagle`` loader reads): a Llama ``config.json`` and tensors ``fc.weight``
  ``(H, 2H)``, ``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight`` (no input norm), optionally ``embed_tokens.weight``. The head reads
  tokens through the target's LM head. Heads trained here add ``d2t`` / ``t2d`` (reduced draft vocabulary).
* EAGLE-3 heads (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, what vLLM's ``eagle3`` loader reads): ``config.json``
  with ``draft_vocab_size`` and tensors ``fc.weight`` ``(H, 3H)``, ``midlayer.input_layernorm.weight``,
  ``midlayer.hidden_norm.weight``, ``midlayer.self_attn.*`` (q/k/v read ``2H``), ``midlayer.mlp.*``,
  ``midlayer.post_attention_layernorm.weight``, ``norm.weight``, ``lm_head.weight`` ``(draft_vocab, H)``, ``d2t``,
  ``t2d``. Feature layers: the config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` when present, else
  ``(2, N/2, N-3)`` counted in ``output_hidden_states`` indices (= decoder layers ``1, N/2-1, N-4``).

* The speculators layout (``speculators_model_type: eagle3``, what ``vllm serve`` reads): the EAGLE-3 layout with
  ``midlayer.`` named ``layers.0.`` and the layer's shape in ``transformer_layer_config``; see
  :mod:`toolkit.eagle.speculators`.

Options of published EAGLE-3 heads read from the config / tensors: ``norm_before_residual``, q/k/v biases, Qwen3
q/k norms, rotary scaling (``rope_scaling`` / ``rope_parameters``: ``llama3``, ``linear``, ``yarn``).
Missing tensors (embedding, EAGLE-1 LM head) are copied from the target. Every mismatch with the target raises one
:class:`toolkit.errors.ConfigError` naming ``field`` (default ``draft.source``).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from toolkit.eagle.files import write_head_files
from toolkit.eagle.head import EagleHead, HeadConfig, eagle3_layers, rope_type, text_config
from toolkit.eagle.speculators import flat_config, is_speculators, rename_to_eagle3
from toolkit.eagle.vocab import from_d2t, to_d2t, to_t2d
from toolkit.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _prefix(variant: str) -> str:
    """Where a published layout keeps the decoder layer's tensors (this toolkit's head names them ``layer.``)."""
    return "layers.0." if variant == "eagle1" else "midlayer."


def to_head_names(state: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """A published layout's tensors (EAGLE-1 / EAGLE-3 repository names) named as :class:`EagleHead`'s state dict;
    the vocabulary maps ``d2t`` / ``t2d`` left out."""
    prefix = _prefix(variant)
    return {("layer." + name[len(prefix):] if name.startswith(prefix) else name): tensor
            for name, tensor in state.items() if name not in ("d2t", "t2d")}


def head_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """Tensors in the published layout (no embedding; no LM head unless the vocabulary is EAGLE-3's own)."""
    config = head.config
    prefix = _prefix(config.variant)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        if name.startswith("lm_head.") and config.variant == "eagle1":
            continue
        if name.startswith("layer."):
            name = prefix + name[len("layer."):]
        state[name] = tensor.detach().contiguous()
    if config.draft_vocab_size != config.vocab_size:
        state["d2t"] = to_d2t(head.draft_to_target.cpu())
        state["t2d"] = to_t2d(head.draft_to_target, config.vocab_size)
    return state


def save_head(head: EagleHead, directory: Path, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` into ``directory`` (created), weights cast to ``dtype``."""
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
             for k, v in head_state(head).items()}
    write_head_files(Path(directory), state, eagle_config(head.config))


def eagle_config(c: HeadConfig, toolkit: bool = True) -> dict:
    """The ``config.json`` of a head in the EAGLE / EAGLE-3 repositories' layout (``toolkit``: with this toolkit's
    ``toolkit_eagle`` section, which names the variant and feature layers exactly)."""
    config = {"architectures": ["LlamaForCausalLM"] if c.variant == "eagle1" else ["LlamaForCausalLMEagle3"],
              "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
              "hidden_act": "silu", "bias": c.fc_bias, "attention_bias": c.attention_bias}
    if c.rope_scaling:
        config["rope_scaling"] = dict(c.rope_scaling)
    if c.variant == "eagle3":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.feature_layers]}
        config["norm_before_residual"] = c.norm_before_residual
    if toolkit:
        config["toolkit_eagle"] = {"variant": c.variant, "feature_layers": c.feature_layers}
    return config


def _read_state(directory: Path, field: str) -> dict[str, torch.Tensor]:
    """The head's tensors: ``model.safetensors`` when present (no code can run from it), else the
    ``pytorch_model.bin`` the published EAGLE-1 heads ship, read by torch's restricted unpickler
    (``weights_only=True``: tensors and plain containers only; refused on torch < 2.6, whose restricted unpickler
    could be made to run code, CVE-2025-32434). Raises ConfigError (``field``) for anything else."""
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(path))
            if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
                raise ConfigError(field, f"{path}: reading a pickled head needs torch >= 2.6 (older restricted "
                                  "unpicklers can run code); convert it to model.safetensors")
            state = torch.load(path, map_location="cpu", weights_only=True)
        except ConfigError:
            raise
        except Exception as exc:  # a corrupt file, or a pickle holding more than tensors (refused, never run)
            raise ConfigError(field, f"{path} is not a file of plain tensors ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
        if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
            raise ConfigError(field, f"{path} does not hold a mapping of tensor names to tensors")
        return state
    raise ConfigError(field, f"{directory} holds no head weights ({' or '.join(WEIGHT_FILES)})")


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight of ``module`` as a plain ``(out, in)`` tensor. A quantized linear (a torchao tensor subclass such
    as ``Int4OpaqueTensor``, which supports neither row indexing nor ``dequantize``) is read through its own kernel:
    ``module(I) = I @ W.T`` on an identity batch gives ``W.T`` at the compute dtype; so is a linear that keeps no
    ``weight`` at all (a GGUF's native int4 blocks, :class:`~toolkit.quant.int4_linear.PackedInt4Linear`)."""
    weight = getattr(module, "weight", None)
    weight = None if weight is None else weight.detach()
    if weight is not None and (type(weight) is torch.Tensor or not isinstance(module, torch.nn.Linear)):
        return weight
    bf16 = weight is None or weight.dtype == torch.bfloat16  # a packed int4 kernel takes bf16 activations
    held = itertools.chain(module.parameters(), module.buffers())  # a packed linear's planes are parameters
    device = weight.device if weight is not None else next(held).device
    eye = torch.eye(module.in_features, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    with torch.no_grad():
        try:
            out = module(eye)
        except RuntimeError:  # a kernel that takes only its own activation dtype
            out = module(eye.to(torch.bfloat16))
    if module.bias is not None:
        out = out - module.bias
    return out.T.contiguous()


def _read_config(directory: Path, source, field: str) -> dict:
    """The head's ``config.json`` as a dict; ConfigError (``field``) when the directory or the file is missing or
    the JSON is invalid."""
    if not directory.is_dir():
        raise ConfigError(field, f"EAGLE head directory {str(source)!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConfigError(field, f"{directory} has no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(field, f"{config_path} is not valid JSON: {exc}") from exc


def _variant(state: dict, directory: Path, field: str) -> str:
    if any(k.startswith("midlayer.") for k in state):
        return "eagle3"
    if any(k.startswith("layers.0.") for k in state):
        return "eagle1"
    raise ConfigError(field, f"{directory}: neither an EAGLE-1 (layers.0.*) nor an EAGLE-3 (midlayer.*) head")


def _feature_layers(raw: dict, variant: str, n_layers: int, field: str) -> list[int]:
    """Target layers the head reads (see the module docstring); ConfigError when one is outside the target."""
    own = raw.get("toolkit_eagle", {})
    if "feature_layers" in own:
        layers = list(own["feature_layers"])
    elif variant == "eagle3":
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids and not all(isinstance(i, int) and 1 <= i <= n_layers - 1 for i in ids):
            raise ConfigError(field, f"eagle_aux_hidden_state_layer_ids {list(ids)} must be output_hidden_states "
                              f"indices 1..{n_layers - 1} of the target's {n_layers} layers (0 is the embeddings, "
                              f"{n_layers} the final norm's output)")
        layers = [i - 1 for i in ids] if ids else eagle3_layers(n_layers)
    else:
        layers = [-1]
    for index in layers:
        if not -n_layers <= index < n_layers:
            raise ConfigError(field, f"feature layer {index} outside the target's {n_layers} layers")
    return layers


def _rope(raw: dict, field: str) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` of a head config in either spelling (``rope_theta`` + ``rope_scaling``,
    or transformers 5's ``rope_parameters``); ConfigError for a length-dependent scaling."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    try:
        kind = rope_type(scaling)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from exc
    return theta, (scaling if kind != "default" else None)


def _head_config(raw: dict, state: dict, variant: str, target_config, field: str) -> HeadConfig:
    """The :class:`HeadConfig` of a checkpoint fitted to a target of config ``target_config``; ConfigError when
    hidden size, vocabulary or feature layers do not fit it."""
    tc = text_config(target_config)
    hidden = raw.get("hidden_size")
    if hidden != tc.hidden_size:
        raise ConfigError(field, f"head hidden_size {hidden} does not fit the target's hidden_size {tc.hidden_size}")
    vocab = raw.get("vocab_size", tc.vocab_size)
    if vocab != tc.vocab_size:
        raise ConfigError(field, f"head vocab_size {vocab} does not fit the target's vocab_size {tc.vocab_size}")
    heads = raw.get("num_attention_heads", tc.num_attention_heads)
    layers = _feature_layers(raw, variant, tc.num_hidden_layers, field)
    draft_vocab = raw.get("draft_vocab_size") or vocab
    if "d2t" in state:
        draft_vocab = state["d2t"].numel()
    theta, scaling = _rope(raw, field)
    prefix = _prefix(variant)
    return HeadConfig(variant=variant, hidden_size=hidden, intermediate_size=raw.get("intermediate_size"),
                      num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
                      head_dim=raw.get("head_dim") or hidden // heads, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                      rope_theta=theta, vocab_size=vocab, draft_vocab_size=draft_vocab,
                      feature_layers=layers, fc_bias="fc.bias" in state,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      attention_bias=f"{prefix}self_attn.q_proj.bias" in state,
                      qk_norm=raw.get("qk_norm", f"{prefix}self_attn.q_norm.weight" in state),
                      rope_scaling=scaling)


def _mapped_state(state: dict, config: HeadConfig, target, field: str) -> tuple[dict, torch.Tensor]:
    """``(tensors named as EagleHead's state dict, draft_to_target)``: published names mapped and (without one of
    its own) the LM head rows of the draft vocabulary taken from the target. A missing embedding stays missing: the
    head shares the target's module (:func:`load_head`)."""
    mapped = to_head_names(state, config.variant)
    if "d2t" in state:
        draft_to_target = from_d2t(state["d2t"])
        if draft_to_target.min() < 0 or draft_to_target.max() >= config.vocab_size:
            raise ConfigError(field, f"d2t maps draft ids outside the target vocabulary of {config.vocab_size}")
    else:
        draft_to_target = torch.arange(config.draft_vocab_size)
    if "lm_head.weight" not in mapped:
        lm = dense_weight(target.get_output_embeddings())
        mapped["lm_head.weight"] = lm[draft_to_target.to(lm.device)]
    return mapped, draft_to_target


def _check_shared_embedding(embedding: torch.nn.Module, shape: tuple, field: str) -> None:
    """ConfigError (``field``) unless the target's input embedding (an ``nn.Embedding`` or a GGUF's
    :class:`~toolkit.quant.block_embedding.BlockEmbedding`) has the head's ``(vocab, H)`` shape."""
    held = (getattr(embedding, "num_embeddings", None), getattr(embedding, "embedding_dim", None))
    if held != shape:
        raise ConfigError(field, f"the target's input embedding is {held}, the head needs {shape}")


def check_tensors(mapped: dict, expected: dict, variant: str, directory: Path, field: str,
                  optional: set[str] = frozenset()) -> None:
    """ConfigError (``field``) unless ``mapped`` (tensors named as :class:`EagleHead`'s state dict) holds every tensor
    of ``expected`` (the head's state dict) but ``optional`` ones, each of the head's shape, and nothing else."""
    for name, tensor in mapped.items():
        if name not in expected:
            raise ConfigError(field, f"{directory}: unexpected tensor {name!r} for an {variant} head")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(field, f"{directory}: tensor {name!r} has shape {tuple(tensor.shape)}, the target "
                                     f"needs {tuple(expected[name].shape)}")
    missing = [k for k in expected if k not in mapped and k not in optional]
    if missing:
        raise ConfigError(field, f"{directory}: missing tensors {missing[:4]}")


def build_checked(config: HeadConfig, field: str, device=None) -> EagleHead:
    """``EagleHead(config)``; a config the head cannot be built from (e.g. a rotary scaling missing its own keys)
    raises ConfigError (``field``) instead of the constructor's KeyError / ValueError."""
    try:
        if device is None:
            return EagleHead(config)
        with torch.device(device):
            return EagleHead(config)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(field, f"the head cannot be built from its config ({type(exc).__name__}: {exc})") from exc


def read_checkpoint(source: str | Path, field: str = "draft.source") -> tuple[Path, dict, dict, str]:
    """``(directory, config, tensors, variant)`` of a head directory in any layout this module reads: the EAGLE /
    EAGLE-3 repositories' (and this toolkit's), or speculators' (:mod:`toolkit.eagle.speculators`), whose config and
    tensor names are mapped onto the EAGLE-3 repository's. Raises ConfigError (``field``) as :func:`load_head`."""
    directory = Path(source).expanduser()
    raw = _read_config(directory, source, field)
    if is_speculators(raw):
        raw = flat_config(raw, field)
        state = rename_to_eagle3(_read_state(directory, field))
        if not any(k.startswith("midlayer.") for k in state):
            raise ConfigError(field, f"{directory}: a speculators eagle3 head without layers.0.* tensors")
        return directory, raw, state, "eagle3"
    state = _read_state(directory, field)
    return directory, raw, state, _variant(state, directory, field)


def load_head(source: str | Path, target, field: str = "draft.source", dtype: torch.dtype | None = None
              ) -> EagleHead:
    """Load a head directory in either published layout and fit it to ``target`` (frozen embedding / LM head copied
    from the target when the checkpoint lacks them; a missing embedding is *shared* with the target, not copied).
    Returns the head in eval mode on the target's device, in ``dtype`` (default: the target's float dtype).

    Raises:
        ConfigError (``field``): missing directory or weights, unknown layout, a hidden size, head shape or
            vocabulary that does not fit the target; on a llama.cpp target, a head reading other layers than the
            final norm's output (:func:`toolkit.engine.llamacpp_forward.check_head`).
    """
    from toolkit.eagle.features import decoder_layers
    from toolkit.models.llamacpp import is_llamacpp

    llamacpp = is_llamacpp(target)  # it hands out its final-norm features without torch layers
    try:
        if not llamacpp:
            decoder_layers(target)
    except AttributeError as exc:
        raise ConfigError(field, f"an EAGLE head needs a decoder-only target with a list of decoder layers "
                          f"({exc})") from exc
    directory, raw, state, variant = read_checkpoint(source, field)
    head = build_checked(_head_config(raw, state, variant, target.config, field), field)
    if llamacpp:  # before the file's embedding and LM head are loaded for the head
        from toolkit.engine.llamacpp_forward import check_head

        check_head(target, head, field)
    mapped, draft_to_target = _mapped_state(state, head.config, target, field)
    shared = "embed_tokens.weight" not in mapped
    expected = head.state_dict()
    check_tensors(mapped, expected, head.config.variant, directory, field, {"embed_tokens.weight"} if shared else set())
    if shared:
        _check_shared_embedding(target.get_input_embeddings(), tuple(expected["embed_tokens.weight"].shape), field)
    head.load_state_dict({k: v.float().cpu() for k, v in mapped.items()}, strict=not shared)  # else checked above
    head.draft_to_target = draft_to_target
    param = next(target.parameters())
    if dtype is None:
        dtype = param.dtype if param.is_floating_point() else torch.float32
    head.to(device=param.device, dtype=dtype)
    if shared:  # no copy of the (vocab, H) table; a GGUF's block embedding dequantizes only the rows looked up
        head.embed_tokens = target.get_input_embeddings()
    head.draft_to_target = head.draft_to_target.to(param.device)
    head.eval()
    head.requires_grad_(False)
    return head


#: heads shipped inside the package, by the embedded target they were trained for
SHIPPED = {"embedded": Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-instruct"}


def resolve_head(source: str, field: str = "draft.source") -> Path:
    """``embedded`` -> the shipped head for the embedded target; anything else is a head directory path.
    Raises :class:`ConfigError` naming ``field`` when the directory does not exist."""
    path = SHIPPED.get(source, Path(str(source)).expanduser())
    if not path.is_dir():
        raise ConfigError(field, f"EAGLE head directory {str(source)!r} does not exist (a head directory with "
                                 "config.json + model.safetensors, or 'embedded')")
    return path
