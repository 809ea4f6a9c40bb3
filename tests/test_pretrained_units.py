"""`zerotrain.pretrained` in the pytest process, at a world of one (issue 48: the only covering test was the world-2
launch of tests/test_deepspeed_programs.py, minutes per mutant).

Every loaded weight is compared with transformers' own `from_pretrained` of the same directory (bit for bit, or its
cast to the run's dtype); the chunked read at offsets a world of one never uses is compared with the flattened
tensor; the partitioned `resize_token_embeddings` with transformers' resize of the plain model under the same seed.
"""
from __future__ import annotations

import gc
import json

import pytest
import torch

VOCAB = 67
STAGE3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def llama_dir(out, tie: bool = False, dtype: torch.dtype = torch.float32, sharded: bool = True,
              base: bool = False) -> str:
    """A one-layer Llama with odd sizes, written as transformers writes it (sharded: several files + index), with
    a generation config that is not the default one (max_new_tokens 7)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                         tie_word_embeddings=tie, use_cache=False)
    torch.manual_seed(0)
    model = (LlamaModel if base else LlamaForCausalLM)(config).to(dtype)
    if not base:
        model.generation_config.max_new_tokens = 7
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": "8KB"} if sharded else {}))
    return str(out)


def reference(directory: str, dtype: torch.dtype = torch.float32) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def gathered(model) -> dict:
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_partitioned_as(model, want: dict, dtype: torch.dtype) -> None:
    from zerotrain.zero.stage3 import ZeroParameter

    params = dict(model.named_parameters())
    assert set(params) == set(want)
    whole = [name for name, p in params.items() if not (isinstance(p, ZeroParameter) and not p._zero.gathered)]
    assert whole == [], f"whole after the load: {whole}"
    got = gathered(model)
    for name, tensor in want.items():
        assert got[name].dtype == dtype, name
        torch.testing.assert_close(got[name], tensor.to(dtype), rtol=0, atol=0, msg=name)


def test_a_live_stage3_config_loads_partitioned_and_transformers_plain_once_it_is_gone(tmp_path, world_of_one):
    """`zerotrain.from_pretrained` with a stage-3 config, then DeepSpeed-Chat's sequence at a world of one:
    `HfDeepSpeedConfig(file)` with bf16 switches `is_deepspeed_zero3_enabled`, `zerotrain.from_pretrained` takes
    its config and dtype, transformers' own `from_pretrained` (a given-but-off `from_tf`) is partitioned too, the
    base model reads the prefixed names; the loaded model is in eval mode with the directory's generation config;
    collected, everything is plain again (`zerotrain.from_pretrained` too)."""
    from transformers import AutoModel, AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

    import zerotrain
    from zerotrain.pretrained import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from zerotrain.zero.stage3 import ZeroParameter

    directory = llama_dir(tmp_path / "model")
    want = reference(directory)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**STAGE3, "bf16": {"enabled": True}}))
    plain = PreTrainedModel.__dict__["from_pretrained"]
    assert not is_deepspeed_zero3_enabled()
    # no live config: the stage-3 config given (a model class or an Auto class; dtype given, else fp32)
    assert_partitioned_as(zerotrain.from_pretrained(LlamaForCausalLM, directory, config=STAGE3, dtype=torch.float16),
                          want, torch.float16)
    assert_partitioned_as(zerotrain.from_pretrained(AutoModelForCausalLM, directory, config=STAGE3), want,
                          torch.float32)
    live = HfDeepSpeedConfig(str(path))
    assert is_deepspeed_zero3_enabled()
    model = zerotrain.from_pretrained(AutoModelForCausalLM, directory)
    assert_partitioned_as(model, want, torch.bfloat16)
    assert not model.training and model.generation_config.max_new_tokens == 7
    script = AutoModelForCausalLM.from_pretrained(directory, from_tf=False, device_map=None, key_mapping={})
    assert_partitioned_as(script, want, torch.bfloat16)
    assert not script.training and script.generation_config.max_new_tokens == 7
    base = AutoModel.from_pretrained(directory)
    assert_partitioned_as(base, {name[len("model."):]: t for name, t in want.items() if name.startswith("model.")},
                          torch.bfloat16)
    del live
    gc.collect()
    assert not is_deepspeed_zero3_enabled()
    assert PreTrainedModel.__dict__["from_pretrained"] is plain
    after = AutoModelForCausalLM.from_pretrained(directory)
    assert not any(isinstance(p, ZeroParameter) for p in after.parameters())
    after = zerotrain.from_pretrained(AutoModelForCausalLM, directory)  # the collected config is not used
    assert not any(isinstance(p, ZeroParameter) for p in after.parameters())
    assert {p.dtype for p in after.parameters()} == {torch.float32}
    # collected inside a zero.Init (whose redirect sits above the config's): a plain load once Init is left
    from zerotrain.zero import Init

    again = HfDeepSpeedConfig(STAGE3)
    try:
        with Init(config=STAGE3):
            del again
            gc.collect()
        after = AutoModelForCausalLM.from_pretrained(directory)
        assert not any(isinstance(p, ZeroParameter) for p in after.parameters())
    finally:  # the config's redirect stays installed (it loads plainly): give transformers its own back
        PreTrainedModel.from_pretrained = plain


def test_below_stage3_it_is_transformers_from_pretrained_in_the_configs_dtype(tmp_path):
    """Stage 2 (or no ZeRO block): transformers' own load, in the config's fp16 / bf16 ("bf16" or "bfloat16"
    block), fp32 without one; a live stage-2 config enables nothing."""
    from transformers import AutoModelForCausalLM

    import zerotrain
    from zerotrain.pretrained import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from zerotrain.zero.stage3 import ZeroParameter

    directory = llama_dir(tmp_path / "model", sharded=False)
    want = reference(directory)
    stage2 = {"zero_optimization": {"stage": 2}}
    for extra, dtype in (({"fp16": {"enabled": True}}, torch.float16), ({"bfloat16": {"enabled": True}},
                         torch.bfloat16), ({"bf16": {"enabled": False}}, torch.float32), ({}, torch.float32)):
        model = zerotrain.from_pretrained(AutoModelForCausalLM, directory, config={**stage2, **extra})
        for name, param in model.named_parameters():
            assert not isinstance(param, ZeroParameter) and param.dtype == dtype, (extra, name)
            torch.testing.assert_close(param.detach(), want[name].to(dtype), rtol=0, atol=0)
    live = HfDeepSpeedConfig(stage2)
    assert not is_deepspeed_zero3_enabled()
    model = zerotrain.from_pretrained(AutoModelForCausalLM, directory, dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    del live


def test_hf_deepspeed_config_reads_dotted_keys_stages_and_offload():
    """transformers' `HfDeepSpeedConfig` accessors: a dotted key (missing at any depth: the default), stage 2 / 3,
    offload of the optimizer or the parameters to cpu or nvme."""
    from zerotrain.pretrained import HfDeepSpeedConfig

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                                "bf16": 5})
    assert config.get_value("zero_optimization.stage") == 2
    assert config.get_value("zero_optimization.offload_optimizer.device") == "nvme"
    assert config.get_value("zero_optimization.missing", "d") == "d"
    assert config.get_value("bf16.enabled", "d") == "d"  # not a block
    assert config.get_value("nothing.at.all") is None
    assert config.is_zero2() and not config.is_zero3() and config.is_offload()
    for block, device, offload in (("offload_param", "cpu", True), ("offload_param", "nvme", True),
                                   ("offload_optimizer", "cpu", True), ("offload_optimizer", "none", False)):
        stage3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3, block: {"device": device}}})
        assert stage3.is_zero3() and not stage3.is_zero2() and stage3.is_offload() == offload, (block, device)
    empty = HfDeepSpeedConfig({})
    assert not (empty.is_zero2() or empty.is_zero3() or empty.is_offload())


def test_from_pretrained_inside_init_takes_transformers_arguments(tmp_path, world_of_one):
    """transformers' `from_pretrained` inside `zerotrain.zero.Init`: config keyword overrides, a config object,
    `dtype` ("auto": the config's, else the first floating weight's; a name; the older `torch_dtype`), a given
    generation config, a subfolder, hub-only arguments accepted; Init's own dtype wins; plain again after Init."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM, PreTrainedModel

    from zerotrain.zero import Init
    from zerotrain.zero.stage3 import ZeroParameter

    directory = llama_dir(tmp_path / "repo" / "sub", dtype=torch.float16, sharded=False)
    want = reference(directory, dtype=torch.float16)
    plain = PreTrainedModel.__dict__["from_pretrained"]
    with Init(config=STAGE3):
        override = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub", rms_norm_eps=1e-3,
                                                        cache_dir=str(tmp_path / "cache"), revision="main")
        assert override.config.rms_norm_eps == 1e-3 and override.config.hidden_size == 24
        assert_partitioned_as(override, want, torch.float16)  # "auto": the config's float16
        config = AutoConfig.from_pretrained(directory)
        config.rms_norm_eps, config.name_or_path = 2e-3, "elsewhere"
        given = LlamaForCausalLM.from_pretrained(directory, config=config, dtype="float32",
                                                 generation_config=GenerationConfig(max_new_tokens=3))
        assert given.config.rms_norm_eps == 2e-3 and config.name_or_path == "elsewhere"  # a copy was named
        assert given.config.name_or_path == directory
        assert given.generation_config.max_new_tokens == 3
        assert_partitioned_as(given, want, torch.float32)
        older = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16)
        assert_partitioned_as(older, want, torch.bfloat16)
        older = LlamaForCausalLM.from_pretrained(directory, config=config, torch_dtype="auto")
        assert_partitioned_as(older, want, torch.float16)
    assert PreTrainedModel.__dict__["from_pretrained"] is plain
    # no dtype in the config: the first floating weight's (float16 here)
    saved = json.loads((tmp_path / "repo" / "sub" / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        saved.pop(key, None)
    (tmp_path / "repo" / "sub" / "config.json").write_text(json.dumps(saved))
    with Init(config=STAGE3):
        assert_partitioned_as(LlamaForCausalLM.from_pretrained(directory), want, torch.float16)
        assert_partitioned_as(LlamaForCausalLM.from_pretrained(directory, dtype="auto"), want, torch.float16)
    with Init(config=STAGE3, dtype=torch.bfloat16):
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        assert_partitioned_as(model, want, torch.bfloat16)
    assert not any(isinstance(p, ZeroParameter) for p in LlamaForCausalLM.from_pretrained(directory).parameters())


def test_what_a_partitioned_load_cannot_honour_is_refused_by_name(tmp_path, world_of_one):
    """Each refused argument by its name (given but off is accepted, above), positional model arguments, a
    variant, a PEFT adapter directory, a name that is not a directory, a directory without safetensors, a
    checkpoint missing a weight."""
    from transformers import LlamaForCausalLM

    from zerotrain.pretrained import _REFUSED_UNDER_INIT
    from zerotrain.zero import Init

    directory = llama_dir(tmp_path / "model", sharded=False)
    with Init(config=STAGE3):
        for name in _REFUSED_UNDER_INIT:
            with pytest.raises(ValueError, match=rf"LlamaForCausalLM.from_pretrained\(\.\.\., {name}=\.\.\.\)"):
                LlamaForCausalLM.from_pretrained(directory, **{name: {"x": 1}})
        with pytest.raises(TypeError, match="positional model arguments"):
            LlamaForCausalLM.from_pretrained(directory, "positional")
        with pytest.raises(ValueError, match="variant=..."):
            LlamaForCausalLM.from_pretrained(directory, variant="fp16")
        with pytest.raises(ValueError, match="a PEFT adapter directory"):
            LlamaForCausalLM.from_pretrained(directory, adapter_kwargs={"_adapter_model_path": directory})
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text("{}")
        with pytest.raises(ValueError, match="adapter"):
            LlamaForCausalLM.from_pretrained(adapter)
        with pytest.raises(FileNotFoundError, match="not a local directory"):
            LlamaForCausalLM.from_pretrained(tmp_path / "nowhere")
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(FileNotFoundError, match="no model.safetensors"):
            LlamaForCausalLM.from_pretrained(empty)
    # a checkpoint without the head: the missing weight is named
    base = llama_dir(tmp_path / "base", base=True, sharded=False)
    with Init(config=STAGE3):
        with pytest.raises(KeyError, match="lm_head.weight"):
            LlamaForCausalLM.from_pretrained(base)


def test_a_model_with_a_head_reads_a_base_checkpoint(tmp_path, world_of_one):
    """A tied-embedding model with a head from its base model's checkpoint (names without `model.`), and the base
    model from a checkpoint of the model with a head (names with it): the values are the checkpoint's."""
    from safetensors.torch import load_file
    from transformers import AutoModel, LlamaForCausalLM

    from zerotrain.zero import Init

    base_dir = llama_dir(tmp_path / "base", tie=True, base=True, sharded=False)
    stored = load_file(f"{base_dir}/model.safetensors")
    head_dir = llama_dir(tmp_path / "head", tie=True)
    with Init(config=STAGE3):
        model = LlamaForCausalLM.from_pretrained(base_dir, tie_word_embeddings=True)
        base = AutoModel.from_pretrained(head_dir)
    assert_partitioned_as(model, {"model." + name: tensor for name, tensor in stored.items()}, torch.float32)
    want = reference(head_dir)
    assert_partitioned_as(base, {name[len("model."):]: t for name, t in want.items() if name.startswith("model.")},
                          torch.float32)


@pytest.mark.parametrize("shape", [(7, 5), (13,), (3, 4, 5), ()])
def test_a_chunk_is_the_flattened_tensors_elements_padded_with_zeros(tmp_path, shape):
    """`_read_chunk` at every (start, end) a rank of a world of 1-4 reads (and past the end: the shard's padding),
    against the flattened tensor: rows cut at both ends, a chunk inside one row, a scalar."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from zerotrain.pretrained import _read_chunk

    tensor = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 8
    save_file({"t": tensor}, str(tmp_path / "t.safetensors"))
    flat = tensor.reshape(-1)
    numel = flat.numel()
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as handle:
        for world in (1, 2, 3, 4):
            per = -(-numel // world)
            for rank in range(world):
                start, end = rank * per, (rank + 1) * per
                chunk = _read_chunk(handle.get_slice("t"), numel, start, end, torch.bfloat16, torch.device("cpu"))
                want = torch.zeros(end - start, dtype=torch.bfloat16)
                piece = flat[start:min(end, numel)]
                want[:piece.numel()] = piece.to(torch.bfloat16)
                assert chunk.dtype == torch.bfloat16, (world, rank)
                torch.testing.assert_close(chunk, want, rtol=0, atol=0, msg=f"{shape} world {world} rank {rank}")
        if numel > 4:
            chunk = _read_chunk(handle.get_slice("t"), numel, 2, 4, torch.float32, torch.device("cpu"))
            torch.testing.assert_close(chunk, flat[2:4], rtol=0, atol=0)


def test_resize_token_embeddings_of_a_partitioned_model_is_transformers_resize(tmp_path, world_of_one):
    """transformers' `resize_token_embeddings` on a model `zero.Init` partitioned: the gathered embeddings and
    head are exactly the plain model's after the same resize under the same seed, partitioned again (and tied
    weights stay one parameter); once an engine trains the model it is refused."""
    from transformers import LlamaForCausalLM

    import zerotrain
    from zerotrain.zero import Init

    for tie in (False, True):
        directory = llama_dir(tmp_path / f"model{tie}", tie=tie, sharded=False)
        plain = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        torch.manual_seed(5)
        plain.resize_token_embeddings(VOCAB + 5)
        want = {name: param.detach().clone() for name, param in plain.named_parameters()}
        with Init(config=STAGE3):
            model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        torch.manual_seed(5)
        model.resize_token_embeddings(VOCAB + 5)
        assert model.get_input_embeddings().weight.ds_numel == (VOCAB + 5) * 24
        assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tie
        assert_partitioned_as(model, want, torch.float32)
    # a base model: no output embeddings
    from transformers import LlamaModel

    directory = llama_dir(tmp_path / "base", base=True, sharded=False)
    plain = LlamaModel.from_pretrained(directory, dtype=torch.float32)
    torch.manual_seed(6)
    plain.resize_token_embeddings(VOCAB + 3)
    with Init(config=STAGE3):
        base = LlamaModel.from_pretrained(directory, dtype=torch.float32)
    torch.manual_seed(6)
    base.resize_token_embeddings(VOCAB + 3)
    assert_partitioned_as(base, {name: p.detach() for name, p in plain.named_parameters()}, torch.float32)
    engine, *_ = zerotrain.initialize(model=model, config=STAGE3)
    with pytest.raises(RuntimeError, match="resize before zerotrain.initialize"):
        model.resize_token_embeddings(VOCAB + 9)
    engine.close()


def test_a_scalar_parameter_loads_whole_and_partitioned(tmp_path, world_of_one):
    """A 0-dim parameter (CLIP's `logit_scale`, a learnable temperature) and a 0-dim persistent buffer, read whole
    (below the persistence threshold) and partitioned (threshold 0, as the HF Trainer's "auto" makes it): the
    saved values. (safetensors' slice of a 0-dim tensor takes `[...]`, not `[:]`.)"""
    from transformers import PretrainedConfig, PreTrainedModel

    from zerotrain.zero import Init

    class ScaledConfig(PretrainedConfig):
        model_type = "zerotrain_test_scaled"

    class Scaled(PreTrainedModel):
        config_class = ScaledConfig
        base_model_prefix = ""

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(5, 3)
            self.logit_scale = torch.nn.Parameter(torch.tensor(0.25))
            self.register_buffer("offset", torch.tensor(0.0))
            self.post_init()

    torch.manual_seed(0)
    model = Scaled(ScaledConfig())
    with torch.no_grad():
        model.logit_scale.fill_(2.6592)
        model.offset.fill_(-1.5)
    model.save_pretrained(tmp_path / "scaled", safe_serialization=True)
    want = {name: param.detach().clone() for name, param in model.named_parameters()}
    for threshold in (100_000, 0):
        config = {**STAGE3, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
        with Init(config=config):
            loaded = Scaled.from_pretrained(tmp_path / "scaled")
        got = gathered(loaded)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"{name} (threshold {threshold})")
        assert loaded.offset.item() == -1.5
