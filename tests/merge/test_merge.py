"""`zerotrain merge` end to end on tiny HF model directories: each method's output against a direct
computation from the input tensors, key filters, errors naming tensor and file, YAML configs with
per-layer parameters, vocabulary policy, LoRA folding (also through `ckpt export --merge-lora`),
the written index and merge_config.json, and `from_pretrained` on the result."""
from __future__ import annotations

import json
import math
import os
import zlib

import pytest
import torch
from conftest import load_dir
from safetensors.torch import save_file

from zerotrain.cli import main
from zerotrain.merge import MergeError, Recipe, merge
from zerotrain.merge.recipe import ModelSpec


def run(*argv: str) -> int:
    return main(["merge", *argv])


def _working_set(inputs: int, model: dict) -> int:
    """merge_config.json's working_set_bytes: the fp32 working set of the largest tensor merged from `inputs`."""
    from zerotrain.merge.run import WORKING_COPIES_FIXED, WORKING_COPIES_PER_INPUT

    largest = max(t.numel() for t in model.values())
    return (WORKING_COPIES_PER_INPUT * inputs + WORKING_COPIES_FIXED) * largest * 4


def test_linear_writes_weighted_mean_index_and_loads(tiny, tmp_path):
    out = str(tmp_path / "out")
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--weights", "1", "3", "--out", out,
               "--shard-size", "30KB") == 0
    a, b, merged = load_dir(tiny["a"]), load_dir(tiny["b"]), load_dir(out)
    assert set(merged) == set(a)
    for name in a:
        torch.testing.assert_close(merged[name], (a[name] + 3 * b[name]) / 4, rtol=1e-6, atol=1e-7)
    with open(os.path.join(out, "model.safetensors.index.json")) as handle:
        index = json.load(handle)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert len(set(index["weight_map"].values())) > 1  # --shard-size split the output
    record = json.load(open(os.path.join(out, "merge_config.json")))
    assert record["method"] == "linear"
    assert record["working_set_bytes"] == _working_set(2, a)  # two inputs, no base
    for entry in record["inputs"]:
        for file, checksum in entry["checksums"].items():
            data = open(os.path.join(entry["path"], file), "rb").read()
            assert checksum == f"crc32:{zlib.crc32(data):08x}"
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name])


def test_task_arithmetic_and_ties(tiny, tmp_path):
    base, a, b = (load_dir(tiny[k]) for k in ("base", "a", "b"))
    out = str(tmp_path / "ta")
    assert run("--method", "task_arithmetic", "--base", tiny["base"], "--models", tiny["a"], tiny["b"],
               "--weights", "0.7", "0.4", "--param", "lambda=0.5", "--out", out) == 0
    merged = load_dir(out)
    for name in base:
        expected = base[name] + 0.5 * (0.7 * (a[name] - base[name]) + 0.4 * (b[name] - base[name]))
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
    record = json.load(open(os.path.join(out, "merge_config.json")))
    assert record["working_set_bytes"] == _working_set(3, base)  # the base and two models in fp32

    out = str(tmp_path / "ties")
    assert run("--method", "ties", "--base", tiny["base"], "--models", tiny["a"], tiny["b"], "--weights", "1", "2",
               "--densities", "0.5", "1.0", "--out", out) == 0
    merged = load_dir(out)
    name = "model.layers.1.mlp.up_proj.weight"
    da = a[name] - base[name]
    flat = da.abs().reshape(-1)
    keep = flat >= flat.sort(descending=True).values[int(0.5 * flat.numel()) - 1]
    da = da * keep.reshape(da.shape)                       # density 0.5 on model a only
    db = b[name] - base[name]
    weighted = torch.stack([1 * da, 2 * db])
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0)  # sign election "sum"
    agree = weighted.sign() == elected
    divisor = (torch.tensor([1.0, 2.0]).reshape(2, 1, 1) * agree).sum(0)
    divisor[divisor == 0] = 1
    expected = base[name] + (weighted * agree).sum(0) / divisor
    torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)


def test_dare_is_seeded_and_keeps_density(tiny, tmp_path):
    outs = []
    for seed, name in ((1, "d1"), (1, "d1again"), (2, "d2")):
        out = str(tmp_path / name)
        assert run("--method", "dare_linear", "--base", tiny["base"], "--models", tiny["a"], "--densities", "0.3",
                   "--param", f"seed={seed}", "--out", out) == 0
        outs.append(load_dir(out))
    base, a = load_dir(tiny["base"]), load_dir(tiny["a"])
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(outs[0][name], outs[1][name], rtol=0, atol=0)
    assert not torch.equal(outs[0][name], outs[2][name])
    delta = outs[0][name] - base[name]
    kept = delta != 0
    frac = kept.float().mean().item()
    sd = math.sqrt(0.3 * 0.7 / delta.numel())
    assert abs(frac - 0.3) < 5 * sd
    torch.testing.assert_close(delta[kept], (a[name] - base[name])[kept] / 0.3, rtol=1e-5, atol=1e-6)


def test_yaml_slerp_with_layer_gradient(tiny, tmp_path):
    config = tmp_path / "slerp.yml"
    config.write_text(f"merge_method: slerp\nbase_model: {tiny['base']}\nmodels:\n  - model: {tiny['base']}\n"
                      f"  - model: {tiny['a']}\nparameters:\n  t:\n    - filter: self_attn\n      value: 0.25\n"
                      f"    - value: [0, 0.5, 1]\ndtype: bfloat16\n")
    out = str(tmp_path / "slerp")
    assert run(str(config), out) == 0
    base, a, merged = load_dir(tiny["base"]), load_dir(tiny["a"]), load_dir(out)

    def slerp(t, x, y):
        cos = float((x / x.norm() * (y / y.norm())).sum())
        if abs(cos) > 0.9995:
            return (1 - t) * x + t * y
        theta = math.acos(cos)
        return (math.sin((1 - t) * theta) * x + math.sin(t * theta) * y) / math.sin(theta)

    cases = {"model.layers.0.mlp.down_proj.weight": 0.0, "model.layers.1.mlp.down_proj.weight": 0.5,
             "model.layers.2.mlp.down_proj.weight": 1.0, "model.layers.1.self_attn.q_proj.weight": 0.25,
             "model.embed_tokens.weight": 0.0, "lm_head.weight": 0.0, "model.norm.weight": 0.0}
    for name, t in cases.items():
        assert merged[name].dtype == torch.bfloat16
        expected = slerp(t, base[name].double(), a[name].double()).to(torch.bfloat16)
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=0)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    flagged = str(tmp_path / "slerp_t1")  # a flag given with the YAML file overrides its setting: t=1 everywhere
    assert run(str(config), flagged, "--param", "t=1") == 0
    for name, tensor in load_dir(flagged).items():
        expected = slerp(1.0, base[name].double(), a[name].double()).to(torch.bfloat16)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_include_exclude(tiny, tmp_path):
    out = str(tmp_path / "ex")
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--exclude", r"mlp\.", "--out", out) == 0
    names = set(load_dir(out))
    assert names and not any("mlp." in n for n in names) and "lm_head.weight" in names
    out = str(tmp_path / "inc")
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--include", r"layers\.0\.",
               "--exclude", "self_attn", "--out", out) == 0
    names = set(load_dir(out))
    assert names and all("layers.0.mlp" in n or "layers.0." in n and "self_attn" not in n for n in names)
    assert not any("self_attn" in n for n in names)


def test_mismatches_name_tensor_and_file(tiny, tmp_path, capsys):
    assert run("--method", "linear", "--models", tiny["a"], tiny["layers2"], "--out", str(tmp_path / "x")) == 1
    err = capsys.readouterr().err
    assert "model.layers.2." in err and tiny["layers2"] in err and ".safetensors" in err
    assert run("--method", "linear", "--models", tiny["a"], tiny["wide"], "--out", str(tmp_path / "y")) == 1
    err = capsys.readouterr().err
    assert "mlp" in err and "shape" in err and tiny["a"] in err and tiny["wide"] in err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
    assert run("--method", "ties", "--models", tiny["a"], "--out", str(tmp_path / "z")) == 1
    assert "base model" in capsys.readouterr().err
    missing = str(tmp_path / "no_such_model")  # a mistyped path: one line naming it, no traceback
    assert run("--method", "linear", "--models", tiny["a"], missing, "--out", str(tmp_path / "w")) == 1
    assert capsys.readouterr().err == f"zerotrain merge: input {missing}: checkpoint directory {missing} does not exist\n"


def test_the_help_lists_merge_in_one_line_and_describes_it_in_full(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert " merge merge models (linear, task arithmetic, TIES, DARE, SLERP, LoRA folding), streamed " in listing
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert "Merge unified zerotrain checkpoints or Hugging Face model directories tensor by tensor" in \
        " ".join(capsys.readouterr().out.split())


def test_vocab_mismatch_error_and_tokenizer_source(tiny, tmp_path, capsys):
    assert run("--method", "linear", "--models", tiny["a"], tiny["vocab80"], "--out", str(tmp_path / "v")) == 1
    err = capsys.readouterr().err
    assert "vocabulary sizes differ" in err and "--tokenizer-source" in err and "80" in err
    out = str(tmp_path / "v2")
    assert run("--method", "task_arithmetic", "--base", tiny["base"], "--models", tiny["a"], tiny["vocab80"],
               "--tokenizer-source", "base", "--out", out) == 0
    base, a, v, merged = (load_dir(p) for p in (tiny["base"], tiny["a"], tiny["vocab80"], out))
    name = "model.embed_tokens.weight"
    assert merged[name].shape[0] == 64
    torch.testing.assert_close(merged[name], base[name] + (a[name] - base[name]) + (v[name][:64] - base[name]))


def _adapter(path, base: dict, rslora: bool, r: int = 4, alpha: int = 8) -> dict:
    """A PEFT-layout LoRA adapter over q_proj and v_proj of every layer (and the embeddings)."""
    os.makedirs(path)
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name in base:
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            module = name[: -len(".weight")]
            out_f, in_f = base[name].shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, in_f, generator=g)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, r, generator=g)
    vocab, hidden = base["model.embed_tokens.weight"].shape
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(r, vocab, generator=g)
    tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(hidden, r, generator=g)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
               "target_modules": ["q_proj", "v_proj", "embed_tokens"], "fan_in_fan_out": False},
              open(os.path.join(path, "adapter_config.json"), "w"))
    return tensors


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_folding_and_ckpt_export(tiny, tmp_path, rslora):
    base = load_dir(tiny["base"])
    adapter = str(tmp_path / "adapter")
    lora = _adapter(adapter, base, rslora)
    scale = 8 / math.sqrt(4) if rslora else 8 / 4
    out = str(tmp_path / "folded")
    assert run("--method", "lora", "--models", tiny["base"], "--param", f"adapter={adapter}", "--out", out) == 0
    merged = load_dir(out)
    for name in base:
        module = "base_model.model." + name[: -len(".weight")]
        if f"{module}.lora_A.weight" in lora:
            delta = lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"] * scale
        elif name == "model.embed_tokens.weight":
            delta = (lora[f"{module}.lora_embedding_B"] @ lora[f"{module}.lora_embedding_A"]).T * scale
        else:
            delta = torch.zeros_like(base[name])
        torch.testing.assert_close(merged[name], base[name] + delta, rtol=1e-5, atol=1e-5)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    # the same folding through `ckpt export --merge-lora`, and through DIR+ADAPTER in another method
    exported = str(tmp_path / "exported")
    assert main(["ckpt", "export", tiny["base"], exported, "--merge-lora", adapter]) == 0
    for name, tensor in load_dir(exported).items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
    plus = str(tmp_path / "plus")
    assert run("--method", "linear", "--models", f"{tiny['base']}+{adapter}", "--out", plus) == 0
    for name, tensor in load_dir(plus).items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
    lora_plus = str(tmp_path / "lora_plus")  # method lora with the adapter given as DIR+ADAPTER, not --param
    assert run("--method", "lora", "--models", f"{tiny['base']}+{adapter}", "--out", lora_plus) == 0
    for name, tensor in load_dir(lora_plus).items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)


def test_source_dtype_kept_and_bad_params(tiny, tmp_path):
    out = str(tmp_path / "bf")
    merge(Recipe("linear", [ModelSpec(tiny["bf16"]), ModelSpec(tiny["bf16"])]), out)
    merged, src = load_dir(out), load_dir(tiny["bf16"])
    for name in src:
        assert merged[name].dtype == torch.bfloat16
        torch.testing.assert_close(merged[name], src[name], rtol=0, atol=0)
    with pytest.raises(MergeError, match="unknown parameter 'lamda'"):
        Recipe("task_arithmetic", [ModelSpec(tiny["a"])], base=tiny["base"], params={"lamda": 1})
    with pytest.raises(MergeError, match="slices"):
        config = tmp_path / "bad.yml"
        config.write_text("merge_method: linear\nslices: []\n")
        from zerotrain.merge import recipe_from_yaml
        recipe_from_yaml(str(config))


def _decimal_crc_bytes(tensors: dict) -> bytes:
    """`tensors` as safetensors bytes whose crc32 spells only the digits 0-9 in hex (a metadata nonce varied until
    it does: ~2% of crcs are such, so a few dozen tries): the manifest entry a decimal parse reads wrongly."""
    from safetensors.torch import save

    for nonce in range(10_000):
        data = save(tensors, metadata={"nonce": str(nonce)})
        if f"{zlib.crc32(data):08x}".isdigit():
            return data
    raise AssertionError("no nonce gave an all-digit crc32")


def _unified(path, model: dict) -> str:
    """A unified zerotrain checkpoint laid out as `checkpoint.format` describes: bf16 model files, fp32
    master weights (both files' crc32s spell only the digits 0-9), trainer state and a manifest with crc32s (written
    with the checkpoint's own helpers)."""
    from zerotrain.checkpoint.integrity import file_crc32, manifest_entry, write_manifest

    os.makedirs(path)
    files = {}
    for kind, tensors in (("model", {n: t.bfloat16() for n, t in model.items()}),
                          ("master_weights", {n: t.float() for n, t in model.items()})):
        file = f"{kind}-00001-of-00001.safetensors"
        with open(os.path.join(path, file), "wb") as handle:
            handle.write(_decimal_crc_bytes(tensors))
        json.dump({"metadata": {}, "weight_map": {n: file for n in tensors}},
                  open(os.path.join(path, f"{kind}.safetensors.index.json"), "w"))
        files[file] = None
        files[f"{kind}.safetensors.index.json"] = None
    json.dump({"global_steps": 10}, open(os.path.join(path, "trainer_state.json"), "w"))
    files["trainer_state.json"] = None
    entries = {name: manifest_entry(os.path.getsize(os.path.join(path, name)),
                                    file_crc32(os.path.join(path, name))) for name in files}
    write_manifest(str(path), entries, {})
    return str(path)


def test_unified_checkpoint_input_reads_masters_and_manifest_checksums(tiny, tmp_path):
    a = load_dir(tiny["a"])
    ckpt = _unified(tmp_path / "global_step10", a)
    with open(tmp_path / "latest", "w") as handle:
        handle.write("global_step10")
    out = str(tmp_path / "out")
    assert run("--method", "linear", "--models", str(tmp_path), tiny["b"], "--out", out) == 0
    b, merged = load_dir(tiny["b"]), load_dir(out)
    for name in a:
        assert merged[name].dtype == torch.bfloat16  # the reference (first) model's file dtype
        # fp32 masters, not the bf16 model files, enter the math
        torch.testing.assert_close(merged[name], ((a[name] + b[name]) / 2).bfloat16(), rtol=0, atol=0)
    record = json.load(open(os.path.join(out, "merge_config.json")))
    manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
    entry = next(e for e in record["inputs"] if e["kind"] == "zerotrain")
    assert entry["path"] == ckpt
    assert set(entry["checksums"]) == {"model-00001-of-00001.safetensors", "master_weights-00001-of-00001.safetensors"}
    for file, checksum in entry["checksums"].items():
        assert manifest["files"][file]["crc32"].isdigit()  # hex, though it reads as a decimal number too
        crc = zlib.crc32(open(os.path.join(ckpt, file), "rb").read())
        assert checksum == f"crc32:{crc:08x}" == f"crc32:{manifest['files'][file]['crc32']}", file


def test_merge_docs_first_example_on_a_real_checkpoint(tiny, tmp_path):
    """docs/merge.md's first example with a checkpoint the engine saved: the manifest's hex crc32s are read as
    hex (they were parsed as decimal: ValueError on any hex letter)."""
    from distributed import run_distributed

    from merge_ranks import real_checkpoint

    ckpt = run_distributed(real_checkpoint, 1, tiny["a"], str(tmp_path / "ckpt"))[0]
    assert os.path.basename(ckpt) == "global_step1"
    out = str(tmp_path / "merged")
    assert run("--method", "linear", "--models", ckpt, tiny["b"], "--weights", "0.5", "0.5", "--out", out) == 0
    from safetensors.torch import load_file
    trained = {}
    for file in os.listdir(ckpt):
        if file.startswith("model-") and file.endswith(".safetensors"):
            trained.update(load_file(os.path.join(ckpt, file)))
    b, merged = load_dir(tiny["b"]), load_dir(out)
    assert set(merged) == set(b) and trained.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(merged[name].float(), (trained[name].float() + b[name]) / 2, rtol=1e-6, atol=1e-6)
    record = json.load(open(os.path.join(out, "merge_config.json")))
    entry = next(e for e in record["inputs"] if e["kind"] == "zerotrain")
    assert entry["checksums"]
    for file, checksum in entry["checksums"].items():
        assert checksum == f"crc32:{zlib.crc32(open(os.path.join(ckpt, file), 'rb').read()):08x}", file


def test_lora_folding_equals_peft_merge_on_gpt2_conv1d_with_patterns(tmp_path):
    """An adapter peft itself trained-shape over GPT-2 (`Conv1D` layers store W transposed: fan_in_fan_out) with
    per-module `rank_pattern` and `alpha_pattern`: every folded weight equals peft's own `merge_and_unload`."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    base = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    # c_attn (16 -> 48) and c_fc (16 -> 64) are not square: a product left untransposed cannot fit;
    # c_proj's (attention: 16 -> 16) is square: only the values tell it
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                           rank_pattern={"c_fc": 2}, alpha_pattern={"attn.c_proj": 3, "c_attn": 12},
                           lora_dropout=0.0, init_lora_weights=False)  # B random, not zero: every delta counts
    wrapped = peft.get_peft_model(model, lora)
    adapter = tmp_path / "adapter"
    wrapped.save_pretrained(str(adapter))
    want = wrapped.merge_and_unload().state_dict()
    from zerotrain.lora import LoraAdapter

    folder = LoraAdapter(str(adapter))
    changed = 0
    for name, weight in base.items():
        got = folder.fold(name, weight)
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        changed += not torch.equal(got, weight)
    assert changed == 2 * 4  # c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj of both layers


def test_lora_trainable_tokens_and_peft_defaults_fold_like_peft_merge(tmp_path):
    """peft's `trainable_token_indices` keyed by module name (matched at its end: `wte` is
    `transformer.wte`), r and lora_alpha left at peft's defaults (absent from adapter_config.json:
    8 and 8), and the names a PEFT-wrapped model gives its base weights: what zerotrain folds equals
    peft's own `merge_and_unload`, and the trained rows replace exactly the rows named (the list form of
    `trainable_token_indices` too); an adapter with lora_A but no lora_B is refused."""
    import peft
    import transformers

    from zerotrain.lora import LoraAdapter, LoraError, base_weight_name, fold_lora, is_adapter_weight

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False)
    model = transformers.GPT2LMHeadModel(config)
    base = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    # lm_head first: a key that is not the module's must not give the module its rows; row 20 is past the
    # hidden size (16), within the vocabulary (32)
    lora = peft.LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True,
                           trainable_token_indices={"lm_head": [2], "wte": [1, 20]},
                           lora_dropout=0.0, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, lora)
    names = [name for name, _ in wrapped.named_parameters()]
    assert base_weight_name("base_model.model.transformer.h.0.attn.c_attn.base_layer.weight") == \
        "transformer.h.0.attn.c_attn.weight"
    assert base_weight_name("base_model.model.transformer.wte.token_adapter.base_layer.weight") == \
        "transformer.wte.weight"
    assert {base_weight_name(n) for n in names if not is_adapter_weight(n)} == set(base)
    with torch.no_grad():  # trained rows that differ from the base's
        for name, param in wrapped.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param))
    adapter = tmp_path / "adapter"
    wrapped.save_pretrained(str(adapter))
    settings = json.loads((adapter / "adapter_config.json").read_text())
    del settings["r"], settings["lora_alpha"]
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    want = wrapped.merge_and_unload().state_dict()
    folder = LoraAdapter(str(adapter))
    for name, weight in base.items():
        torch.testing.assert_close(folder.fold(name, weight), want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # fold_lora (the public function): from a directory or a LoraAdapter, in the weight's dtype; integers untouched
    name = "transformer.h.0.attn.c_attn.weight"
    for source in (str(adapter), folder):
        got = fold_lora(base[name].bfloat16(), name, source)
        assert got.dtype == torch.bfloat16 and torch.equal(got, folder.fold(name, base[name].bfloat16()).bfloat16())
    assert torch.equal(fold_lora(torch.arange(4), "transformer.wte.weight", folder), torch.arange(4))
    for name, rows in (("transformer.wte.weight", [1, 20]), ("lm_head.weight", [2])):
        changed = (folder.fold(name, base[name]) != base[name]).any(dim=1)
        assert changed.nonzero().flatten().tolist() == rows, name
    # the list form: rows of the input embedding
    listed = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                 peft.LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True,
                                                 trainable_token_indices=[3], init_lora_weights=False))
    with torch.no_grad():
        for name, param in listed.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(1.0)
    listed.save_pretrained(str(tmp_path / "listed"))
    wte = dict(listed.named_parameters())["base_model.model.transformer.wte.token_adapter.base_layer.weight"]
    wte = wte.detach().clone()  # merge_and_unload changes it in place
    folded = LoraAdapter(str(tmp_path / "listed")).fold("transformer.wte.weight", wte)
    torch.testing.assert_close(folded, listed.merge_and_unload().state_dict()["transformer.wte.weight"])
    assert (folded != wte).any(dim=1).nonzero().flatten().tolist() == [3]
    # half a pair (lora_A without lora_B) is refused naming what is missing
    (tmp_path / "half").mkdir()
    save_file({"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.ones(8, 16)},
              str(tmp_path / "half" / "adapter_model.safetensors"))
    (tmp_path / "half" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(LoraError, match="c_attn.weight' lack lora_B"):
        LoraAdapter(str(tmp_path / "half"))


def test_per_layer_values_interpolate_between_their_neighbours():
    from zerotrain.merge.recipe import evaluate

    assert evaluate([0.0, 1.0], "model.layers.1.mlp", 0.5, "t") == pytest.approx(0.5)
    assert evaluate([0.0, 1.0, 3.0], "model.layers.3.mlp", 0.75, "t") == pytest.approx(2.0)  # between 1 and 3
    assert evaluate([0.0, 1.0, 3.0], "model.layers.4.mlp", 1.0, "t") == pytest.approx(3.0)  # the last layer


def test_yaml_slerp_takes_its_base_model_first_and_other_methods_keep_their_list(tmp_path):
    from zerotrain.merge.recipe import recipe_from_yaml

    def paths(text: str) -> list[str]:
        config = tmp_path / "recipe.yml"
        config.write_text(text)
        return [m.path for m in recipe_from_yaml(str(config)).models]

    assert paths("merge_method: slerp\nbase_model: B\nmodels:\n  - model: A\n") == ["B", "A"]
    assert paths("merge_method: slerp\nbase_model: B\nmodels:\n  - model: B\n  - model: A\n") == ["B", "A"]
    assert paths("merge_method: ties\nbase_model: B\nmodels:\n  - model: A\n  - model: C\n") == ["A", "C"]


def test_without_a_shard_size_the_output_is_one_file(tiny, tmp_path):
    out = tmp_path / "out"
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--out", str(out)) == 0
    assert len(list(out.glob("*.safetensors"))) == 1  # the default shard size (5 GiB) holds a tiny model whole


def test_an_adapter_changing_a_weight_the_model_lacks_is_refused_naming_it(tiny, tmp_path, capsys):
    """A LoRA adapter for another model (a layer this one does not have) is refused up front, not folded in part."""
    base = load_dir(tiny["layers2"])
    adapter = str(tmp_path / "adapter")
    _adapter(adapter, load_dir(tiny["base"]), rslora=False)  # three layers' q/v_proj: layer 2 is not in layers2
    out = str(tmp_path / "out")
    assert "model.layers.2.self_attn.q_proj.weight" not in base
    assert run("--method", "linear", "--models", f"{tiny['layers2']}+{adapter}", "--out", out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zerotrain merge: LoRA adapter {adapter}/adapter_model.safetensors changes "
                          f"'model.layers.2.self_attn.") and f"which {tiny['layers2']} does not have" in err, err
    assert len(err.splitlines()) == 1 and not os.path.exists(out)


def test_the_output_may_be_an_empty_directory_not_a_file_or_a_directory_with_files(tiny, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--out", str(empty)) == 0
    assert set(load_dir(str(empty))) == set(load_dir(tiny["a"]))
    capsys.readouterr()
    for target in (empty, tmp_path / "file"):  # now holds the merged model / a plain file
        (tmp_path / "file").write_text("x")
        assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--out", str(target)) == 1
        assert capsys.readouterr().err == f"zerotrain merge: output {target} exists and is not an empty directory\n"
    assert (tmp_path / "file").read_text() == "x"
    nested = tmp_path / "new" / "parents" / "out"  # directories above it are made
    assert run("--method", "linear", "--models", tiny["a"], tiny["b"], "--out", str(nested)) == 0
    assert set(load_dir(str(nested))) == set(load_dir(tiny["a"]))
    capsys.readouterr()
    failed = tmp_path / "failed"  # fails at its first tensor, after the output was planned: one line, nothing left
    assert run("--method", "slerp", "--base", tiny["base"], "--models", tiny["base"], tiny["a"], "--out",
               str(failed)) == 1
    assert capsys.readouterr().err.startswith("zerotrain merge: slerp needs parameter t")
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "new"]
