"""``precision: native`` on a Hugging Face checkpoint already quantized by torchao or bitsandbytes: the weights load
as stored (no dequantize-requantize round trip) and decode as transformers' own loader does.

Each checkpoint is a tiny random-weight Llama quantized and saved by transformers itself (``from_pretrained(...,
quantization_config=TorchAoConfig / BitsAndBytesConfig)`` then ``save_pretrained``), on CPU. With torchao 0.18 a CPU
can make and run ``IntxWeightOnlyConfig`` (torchao's int4 weight-only in ``IntxUnpackedToInt8Tensor``) and the int8
configs; ``Int4WeightOnlyConfig`` weights cannot be made on a CPU (``Int4Tensor`` needs mslk's CUDA kernels,
``tile_packed_to_4d`` tinygemm on CUDA) and the CPU-only ``Int4OpaqueTensor`` has no serialization — such a
checkpoint is refused on CPU from its config alone, which is what the test checks (no fabricated weights).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file
from test_decoder import hf_greedy
from test_models import word_tokenizer

import toolkit
from toolkit.errors import ConfigError
from toolkit.recipe import GenerationSpec, ModelSpec, Recipe, SpeculationSpec

pytest.importorskip("torchao")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny forwards: threading overhead would dominate

FORMATS = ["torchao-int4", "torchao-int8", "bnb-nf4", "bnb-int8"]
PROMPT = torch.tensor([[5, 9, 13, 2, 5, 9, 13, 2, 5, 9]])
NEW_TOKENS = 12


def _config(name: str):
    import torchao.quantization as q
    from transformers import BitsAndBytesConfig, TorchAoConfig

    return {"torchao-int4": lambda: TorchAoConfig(q.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                         granularity=q.PerGroup(32))),
            "torchao-int8": lambda: TorchAoConfig(q.Int8WeightOnlyConfig()),
            "bnb-nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32),
            "bnb-int8": lambda: BitsAndBytesConfig(load_in_8bit=True)}[name]()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{format: directory}``: the same tiny Llama quantized and saved by transformers in each format."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prequantized")
    tiny_llama(seed=0, initializer_range=0.2).save_pretrained(root / "fp32")
    word_tokenizer(128).save_pretrained(root / "fp32")
    out = {"fp32": root / "fp32"}
    for name in FORMATS:
        model = AutoModelForCausalLM.from_pretrained(root / "fp32", quantization_config=_config(name),
                                                     device_map="cpu", dtype=torch.float32)
        model.save_pretrained(root / name)
        word_tokenizer(128).save_pretrained(root / name)
        out[name] = root / name
    return out


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _stored_parts(module_name: str, weight) -> dict[str, torch.Tensor]:
    """``{file key: the loaded tensor that must hold its bytes}`` for one quantized linear weight."""
    if type(weight).__module__.startswith("torchao"):  # flattened by torchao as _weight_<inner tensor name>
        names = [*weight.tensor_data_names, *getattr(weight, "optional_tensor_data_names", [])]
        return {f"{module_name}._weight_{n}": getattr(weight, n) for n in names if getattr(weight, n) is not None}
    parts = {f"{module_name}.weight": weight.data}
    state = getattr(weight, "quant_state", None)
    if state is not None:  # NF4 / FP4: packed codes, absmax, quant map (and the nested absmax state)
        parts |= {f"{module_name}.weight.absmax": state.absmax, f"{module_name}.weight.quant_map": state.code}
        if state.state2 is not None:
            parts |= {f"{module_name}.weight.nested_absmax": state.state2.absmax,
                      f"{module_name}.weight.nested_quant_map": state.state2.code}
    else:  # LLM.int8(): int8 rows and their scales
        parts[f"{module_name}.SCB"] = weight.SCB
    return parts


def _recipe(source: str, precision: str = "native", draft: ModelSpec | None = None, **spec) -> Recipe:
    spec = spec or {"drafter": "lookup", "max_cached_requests": 4, "num_draft_tokens": 8}
    return Recipe(name="prequantized", target=ModelSpec(source=source, precision=precision, device="cpu"),
                  draft=draft, spec=SpeculationSpec(**spec),
                  generation=GenerationSpec(max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True))


@pytest.mark.parametrize("name", FORMATS)
def test_native_weights_are_the_checkpoints_bytes_and_decode_as_transformers_loads_them(checkpoints, name):
    from transformers import AutoModelForCausalLM

    directory = str(checkpoints[name])
    generator = toolkit.build(_recipe(directory))
    model = generator.target
    stored = load_file(f"{directory}/model.safetensors")
    checked = set()
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            assert type(weight).__module__.split(".")[0] in ("torchao", "bitsandbytes"), (module_name, type(weight))
            for key, tensor in _stored_parts(module_name, weight).items():
                assert tensor.dtype == stored[key].dtype and torch.equal(_as_bytes(tensor), _as_bytes(stored[key])), key
                checked.add(key)
    quantized_keys = {k for k in stored if k.endswith(("_weight_qdata", ".absmax", ".SCB"))}
    assert quantized_keys and quantized_keys <= checked  # every quantized tensor of the file, byte for byte
    library, bits = name.split("-")
    assert model.toolkit_backend == {"bnb": "bitsandbytes"}.get(library, library)
    assert generator.weights["target"].startswith(f"native ({model.toolkit_backend} ")
    assert generator.weights["target"].endswith("from the checkpoint)")

    reference = AutoModelForCausalLM.from_pretrained(directory, device_map="cpu").eval()
    expected = hf_greedy(reference, PROMPT, NEW_TOKENS)
    assert generator.generate(PROMPT).token_ids == expected
    again = generator.generate(PROMPT)  # the lookup drafter remembers the first request: its drafts are accepted
    assert again.token_ids == expected and again.stats.tokens_per_round > 1


def test_other_precisions_dequantize_and_never_requantize(checkpoints):
    from toolkit.models import load_model, weights_note
    from toolkit.session import plan

    directory = str(checkpoints["torchao-int4"])
    native, _ = load_model(ModelSpec(source=directory, precision="native", device="cpu"))
    plain, _ = load_model(ModelSpec(source=directory, precision="fp32", device="cpu"))
    q_proj = native.model.layers[0].self_attn.q_proj.weight
    assert type(plain.model.layers[0].self_attn.q_proj.weight) is torch.nn.Parameter
    assert torch.equal(plain.model.layers[0].self_attn.q_proj.weight, q_proj.dequantize().float())
    assert plain.toolkit_weights == ("fp32 (dequantized from the checkpoint's torchao int4 weight-only, group 32, "
                                     "symmetric)")
    assert weights_note(plain) == plain.toolkit_weights
    assert weights_note(copy.deepcopy(plain).to(torch.bfloat16)) == f"bf16 (cast from {plain.toolkit_weights})"
    for precision in ("int4", "int8"):
        with pytest.raises(ConfigError, match=rf"target\.precision: .*already quantized \(torchao int4 weight-only.*"
                                              rf"{precision} would dequantize and re-quantize.*"
                                              r"\(allowed: native, fp32, fp16, bf16\)"):
            ModelSpec(source=directory, precision=precision).validate("target")
    self_draft = _recipe(directory, draft=ModelSpec(precision="int4"), drafter="self")
    with pytest.raises(ConfigError, match=r"draft\.precision: .*int4 would dequantize and re-quantize"):
        plan(self_draft)  # a self draft is the target's weights at draft.precision: a re-quantization too


def test_formats_without_a_cpu_kernel_or_a_native_loader_are_refused_from_the_config(checkpoints, tmp_path):
    """torchao ``Int4WeightOnlyConfig`` checkpoints run on CUDA kernels only with torchao 0.18 (their weights cannot
    be made on a CPU either: only the config is written here); a method the toolkit does not read as is (GPTQ)
    cannot be ``native``."""
    import json

    import torchao.quantization as q
    from transformers import TorchAoConfig

    from toolkit.models import load_model

    config = json.loads((checkpoints["fp32"] / "config.json").read_text())
    for name, quantization in (("int4", TorchAoConfig(q.Int4WeightOnlyConfig(group_size=32)).to_dict()),
                               ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(ConfigError, match=r"target\.device: torchao runs Int4WeightOnlyConfig weights .* only on CUDA "
                                          r"kernels.*cannot run on cpu.*\(allowed: cuda\)"):
        load_model(ModelSpec(source=str(tmp_path / "int4"), precision="native", device="cpu"), "target")
    with pytest.raises(ConfigError, match=r"target\.precision: native loads checkpoints quantized by torchao or "
                                          r"bitsandbytes as they are; .* is quantized with gptq"):
        ModelSpec(source=str(tmp_path / "gptq"), precision="native").validate("target")


def test_a_quantized_checkpoint_is_native_by_default_for_your_model(checkpoints):
    from eval.space_file import load_space
    from toolkit.resources import resolve
    from toolkit_cli.app import _retarget

    quantized, plain = str(checkpoints["bnb-nf4"]), str(checkpoints["fp32"])
    exact = Recipe.load(resolve("short-exact", "", "recipe"))  # fp32 on the embedded model
    assert exact.with_target(quantized).target.precision == "native"
    assert exact.with_target(plain).target.precision == "fp32"
    main = Recipe.load(resolve("short", "", "recipe"))  # native on the embedded GGUF
    assert _retarget(main, quantized, None).target.precision == "native"
    moved = _retarget(main, plain, None).target  # no weights of its own: the re-quantization native replaced
    assert (moved.precision, moved.backend) == ("int4", "auto")
    sp = load_space("short")
    sp.for_model(quantized)
    assert sp.base["target"]["precision"] == "native"
    searched = {d.name: d.searched for d in sp.dimensions}["target_precision"]
    assert "native" in searched and not {"int8", "int4"} & set(searched)
