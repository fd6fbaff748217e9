"""What HF ``generate`` hands a callable ``custom_generate``, in the toolkit's terms (checked on transformers 5.24).

HF runs its usual input preparation (the model's ``GenerationConfig`` merged with the call's keywords, special tokens,
attention mask and position ids, ``max_length`` from ``max_new_tokens``, the logits processors and stopping criteria
it builds from the config) and then calls the callable as ``custom_generate(model, input_ids, logits_processor=...,
stopping_criteria=..., generation_config=..., **model_kwargs)`` (``transformers/generation/utils.py``,
``GenerationMixin.generate``, step 9; HF docs, "Generation strategies" → "Reusing generate's preparation steps by
passing a callable"). :func:`read_request` turns that into one prompt per row (left padding removed) and a
:class:`~toolkit.recipe.GenerationSpec`. Whatever would change the output and the toolkit's decoder does not do is
refused with one :class:`~toolkit.errors.ConfigError` naming the HF field and what is supported; nothing that changes
the tokens is ignored silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitNormalization,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from toolkit.errors import ConfigError
from toolkit.recipe import GenerationSpec

#: what the toolkit's decoder honours of a ``generate`` call (also the text of every refusal)
SUPPORTED = ("max_new_tokens", "max_length", "eos_token_id (an id or a list)", "pad_token_id", "do_sample",
             "temperature", "top_k", "top_p", "num_return_sequences (sampling)", "return_dict_in_generate",
             "attention_mask (left padding)", "streamer (batch 1)")

#: HF logits processors -> the generate argument / GenerationConfig field that adds them (all change the output)
_PROCESSOR_FIELDS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "TopHLogitsWarper": "top_h",
    "MinPLogitsWarper": "min_p",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
#: HF stopping criteria -> the field that adds them (MaxLength and Eos criteria are honoured)
_CRITERIA_FIELDS = {"MaxTimeCriteria": "max_time", "StopStringCriteria": "stop_strings",
                    "ConfidenceCriteria": "assistant_confidence_threshold"}
#: GenerationConfig fields that change the output without a processor, with the values that leave it unchanged
_NEUTRAL = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "penalty_alpha": (None, 0), "dola_layers": (None,),
    "min_new_tokens": (None, 0),
    "constraints": (None,), "force_words_ids": (None,), "output_scores": (None, False),
    "output_logits": (None, False), "output_attentions": (None, False), "output_hidden_states": (None, False),
}
_WHY = {"output_scores": "the decoder keeps no per-step scores to return honestly",
        "output_logits": "the decoder keeps no per-step logits to return honestly",
        "cache_implementation": "the toolkit brings its own caches: pass kv={'policy': 'quantized', ...} to "
                                "toolkit.hf.speculative"}
#: model inputs HF prepares itself (read or checked here); anything else given to generate is refused
_PREPARED = ("attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache", "past_key_values")


@dataclass
class Request:
    """One ``generate`` call in the toolkit's terms.

    Attributes:
        prompts: one ``(1, prompt_len_i)`` long tensor per row of ``input_ids``, its left padding removed.
        spec: the generation arguments (``max_new_tokens`` counted from the padded prompt length, as HF does).
        pad_token_id: what pads rows that stopped early (HF's rule: ``pad_token_id``, else the first EOS id).
        return_dict: return a ``GenerateDecoderOnlyOutput`` instead of the ``(batch, length)`` tensor.
    """

    prompts: list[torch.Tensor]
    spec: GenerationSpec
    pad_token_id: int
    return_dict: bool


def refuse(field: str, value: object, why: str = "it changes the output and the toolkit's decoder does not apply "
           "it") -> ConfigError:
    """The one error for a ``generate`` argument the toolkit's decoder does not honour (field = HF's name)."""
    return ConfigError(field, f"{value!r} is not supported by toolkit.hf.speculative: {why}; supported: "
                       f"{', '.join(SUPPORTED)}; pass the neutral value or call generate without custom_generate")


def read_request(input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                 model_kwargs: dict) -> Request:
    """Read one call (the arguments HF passes to a callable ``custom_generate``).

    Args:
        input_ids: ``(batch, padded_prompt_len)`` prompt ids (rows left-padded where ``attention_mask`` has zeros).
        logits_processor / stopping_criteria: HF's prepared lists (built from the config plus the caller's own).
        generation_config: the merged ``GenerationConfig`` (``max_length`` already includes the prompt).
        model_kwargs: HF's prepared model inputs (``attention_mask``, ``position_ids``, an empty ``cache``, ...).

    Raises:
        ConfigError: naming the HF field for every setting that changes the output and is not supported
            (:data:`SUPPORTED`), a non-empty ``cache`` / ``past_key_values``, other model inputs, right padding.
    """
    _check_config(generation_config)
    _check_criteria(stopping_criteria)
    do_sample = bool(generation_config.do_sample)
    temperature, top_k, top_p = _warpers(logits_processor, do_sample)
    prompts = _prompts(input_ids, model_kwargs)
    eos = _id_list(generation_config.eos_token_id)
    seed = int(torch.randint(0, 2**31 - 1, (1,))) if do_sample else 0  # torch.manual_seed makes a call reproducible
    max_new = max(1, int(generation_config.max_length) - input_ids.shape[1])  # HF commits >= 1 token
    spec = GenerationSpec(max_new_tokens=max_new, do_sample=do_sample, temperature=temperature, top_k=top_k,
                          top_p=top_p, ignore_eos=not eos, eos_token_id=eos, seed=seed)
    spec.validate("generation_config")
    pad = generation_config.pad_token_id
    if pad is None and getattr(generation_config, "_pad_token_tensor", None) is not None:
        pad = generation_config._pad_token_tensor
    pad = _id_list(pad)[0] if _id_list(pad) else (eos[0] if eos else 0)
    return Request(prompts, spec, pad, bool(generation_config.return_dict_in_generate))


def _check_config(config) -> None:
    for field, neutral in _NEUTRAL.items():
        value = getattr(config, field, None)
        if not any(value is n or (not isinstance(value, (list, dict)) and value == n) for n in neutral):
            raise refuse(field, value, _WHY.get(field, "it changes the output and the toolkit's decoder does not "
                                                        "apply it"))
    if getattr(config, "cache_implementation", None) == "quantized":
        raise refuse("cache_implementation", "quantized", _WHY["cache_implementation"])


def _check_criteria(stopping_criteria) -> None:
    for criterion in stopping_criteria or ():
        if type(criterion) in (MaxLengthCriteria, EosTokenCriteria):
            continue  # the decoder stops at max_length and at EOS ids itself
        name = type(criterion).__name__
        field = _CRITERIA_FIELDS.get(name, "stopping_criteria")
        raise refuse(field, name if field == "stopping_criteria" else name + " (from " + field + ")")


def _warpers(logits_processor, do_sample: bool) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` of HF's sampling warpers (greedy: argmax, which no warper changes)."""
    found: dict[type, object] = {}
    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    for processor in logits_processor or ():
        kind = type(processor)
        if kind is LogitNormalization:  # log-softmax: changes neither the argmax nor the sampled distribution
            continue
        if kind not in order:
            field = _PROCESSOR_FIELDS.get(kind.__name__, "logits_processor")
            raise refuse(field, kind.__name__ if field == "logits_processor" else f"{kind.__name__} (from {field})")
        if kind in found or any(order.index(k) > order.index(kind) for k in found):
            raise refuse("logits_processor", [type(p).__name__ for p in logits_processor],
                         "the warpers must be applied as HF builds them: temperature, then top-k, then top-p, once "
                         "each")
        if getattr(processor, "filter_value", float("-inf")) != float("-inf"):
            raise refuse("logits_processor", f"{kind.__name__}(filter_value={processor.filter_value})",
                         "only filter_value=-inf removes tokens exactly")
        found[kind] = processor
    if not do_sample:
        return 1.0, 0, 1.0
    temperature = found[TemperatureLogitsWarper].temperature if TemperatureLogitsWarper in found else 1.0
    top_k = found[TopKLogitsWarper].top_k if TopKLogitsWarper in found else 0
    top_p = found[TopPLogitsWarper].top_p if TopPLogitsWarper in found else 1.0
    return float(temperature), int(top_k), float(top_p)


def _prompts(input_ids: torch.Tensor, model_kwargs: dict) -> list[torch.Tensor]:
    """One ``(1, n_i)`` prompt per row, without its left padding; checks the prepared model inputs."""
    for key, value in model_kwargs.items():
        if key not in _PREPARED and value is not None:
            raise refuse(key, type(value).__name__, "the toolkit's decoder feeds the model input_ids and its own "
                         "caches only")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise refuse("past_key_values", f"a cache holding {cache.get_seq_length()} tokens",
                     "the toolkit's decoder starts from the prompt with its own caches")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise refuse("input_ids", tuple(input_ids.shape), "the toolkit's decoder needs token ids (batch, prompt_len)"
                     " (inputs_embeds are not supported)")
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(input_ids.device).long()
    positions = model_kwargs.get("position_ids")
    prompts = []
    for row in range(input_ids.shape[0]):
        keep = mask[row]
        start = int(keep.shape[0] - keep.sum())
        if not bool((keep[start:] == 1).all()) or bool(keep[:start].any()):
            raise refuse("attention_mask", f"row {row}: {keep.tolist()}", "only left padding (zeros before the "
                         "prompt's first token) is supported: tokenize with padding_side='left' (without a mask HF "
                         "masks every pad_token_id in the prompt: pass attention_mask if the prompt holds that id)")
        if positions is not None:
            row_positions = positions[min(row, positions.shape[0] - 1), start:].to(input_ids.device)
            if not torch.equal(row_positions, torch.arange(keep.shape[0] - start, device=input_ids.device)):
                raise refuse("position_ids", "custom positions", "the decoder numbers each row's tokens from 0")
        prompts.append(input_ids[row:row + 1, start:])
    return prompts


def _id_list(value) -> list[int]:
    """Token ids of an int, a list of ints or a tensor (HF allows each for eos/pad ids); ``None`` -> ``[]``."""
    if value is None:
        return []
    if torch.is_tensor(value):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
