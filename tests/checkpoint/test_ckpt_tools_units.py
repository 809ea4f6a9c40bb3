"""`zerotrain ckpt inspect|verify|export` in-process (issue #48, round 4): the fast covering test of
`checkpoint/tools.py` and `checkpoint/command.py`. One bf16 save at a world of one (model weights in bf16, fp32
masters beside them, AdamW states), made once for the module; each tool's report against what the engine held."""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckpt_common import make_engine, train
from zerotrain.checkpoint import tools
from zerotrain.checkpoint.command import add_ckpt_parser, run_ckpt
from zerotrain.checkpoint.format import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(save dir, tag directory, the engine's fp32 weights, its bf16 weights); the world of one torn down again."""
    from zerotrain import dist

    root = tmp_path_factory.mktemp("ckpt_tools")
    started = not dist.is_initialized()
    try:
        engine = make_engine(stage=2, precision="bf16")
        train(engine, 0, 2)
        engine.add_checkpoint_files({"tokenizer.json": b'{"t": 1}'})
        path = engine.save_checkpoint(str(root / "ckpt"))
        weights = {k: v.float().clone() for k, v in engine.full_state_dict().items()}
        module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.close()
    finally:
        if started:
            dist.destroy_process_group()
    return str(root / "ckpt"), path, weights, module


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotrain")
    add_ckpt_parser(parser.add_subparsers(dest="command"), "zerotrain")
    return parser.parse_args(["ckpt", *argv])


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return run_ckpt(_parse(*argv), out), out.getvalue()


def test_inspect_lists_every_tensor_with_its_bytes_and_the_writer(saved, capsys):
    save_dir, path, weights, module = saved
    report = tools.inspect_checkpoint(save_dir)
    assert report["path"] == path and report["kind"] == "zerotrain"
    assert report["global_steps"] == 2 and report["global_samples"] == 16
    assert report["topology"]["world_size"] == 1 and report["zerotrain_version"]
    model = {row["name"]: row for row in report["tensors"]["model"]}
    assert set(model) == set(module)
    for name, tensor in module.items():
        assert model[name]["shape"] == list(tensor.shape) and model[name]["dtype"] == str(tensor.dtype).split(".")[1]
        assert model[name]["bytes"] == tensor.numel() * tensor.element_size()
        assert os.path.exists(os.path.join(path, model[name]["file"]))
    masters = {row["name"]: row for row in report["tensors"]["master_weights"]}
    assert {name: row["bytes"] for name, row in masters.items()} == {
        name: tensor.numel() * 4 for name, tensor in weights.items() if not name.startswith(("frozen", "shift"))}
    assert report["bytes"]["model"] == sum(t.numel() * t.element_size() for t in module.values())
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert report["files"] == len(manifest["files"])
    assert report["total_file_bytes"] == sum(os.path.getsize(os.path.join(path, n)) for n in manifest["files"])

    status, text = _run("inspect", save_dir)
    assert status == 0
    lines = text.splitlines()
    assert lines[0] == f"checkpoint  {path}  (zerotrain)"
    assert lines[1] == "step        2  (samples consumed: 16)"
    assert lines[2].startswith("written by  ") and "world_size=1" in lines[2]
    assert f"model: {len(module)} tensors, {_binary(report['bytes']['model'])}\n" in text
    assert f"files       {report['files']} ({_binary(report['total_file_bytes'])})\n" in text
    fc1 = next(line for line in lines if line.strip().startswith("fc1.weight ") and "bfloat16" in line)
    assert "7x6" in fc1 and f"{7 * 6 * 2:>12,}" in fc1
    status, summary = _run("inspect", "--summary", save_dir)
    assert status == 0 and "fc1.weight" not in summary and f"model: {len(module)} tensors" in summary
    status, as_json = _run("inspect", "--json", "--summary", save_dir)
    assert status == 0 and json.loads(as_json)["tensors"]["model"] == len(module)
    status, as_json = _run("inspect", "--json", path)
    assert status == 0 and json.loads(as_json)["tensors"]["model"] == report["tensors"]["model"]


def _binary(nbytes: int) -> str:
    """How the tools print a size: bytes below 1 KiB, else KiB / MiB / GiB with one decimal."""
    if nbytes < 1024:
        return f"{nbytes:,} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"


def test_verify_names_each_bad_file_and_says_ok_otherwise(saved, tmp_path, capsys):
    save_dir, path, _, _ = saved
    result = tools.verify_checkpoint(path)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert result == {"path": path, "ok": True, "files": len(manifest["files"]),
                      "bytes": sum(int(e["size"]) for e in manifest["files"].values())}
    status, text = _run("verify", save_dir)
    assert status == 0 and text == f"OK {path}: {result['files']} files, {_binary(result['bytes'])} match the manifest\n"
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    model_file = sorted(n for n in manifest["files"] if n.startswith("model") and n.endswith(".safetensors"))[0]
    data = bytearray(open(os.path.join(broken, model_file), "rb").read())
    data[-1] ^= 0xFF
    open(os.path.join(broken, model_file), "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=f"^{broken}/{model_file}: checksum mismatch"):
        tools.verify_checkpoint(broken)
    os.truncate(os.path.join(broken, "trainer_state.json"), 3)
    with pytest.raises(CheckpointError, match=f"^2 of {len(manifest['files'])} files are bad:\n  ") as caught:
        tools.verify_checkpoint(broken)
    assert model_file in str(caught.value) and "trainer_state.json" in str(caught.value)
    capsys.readouterr()
    assert _run("verify", broken)[0] == 1
    assert capsys.readouterr().err.startswith("zerotrain ckpt verify: 2 of ")
    with pytest.raises(CheckpointError, match=f"is a file; give the checkpoint directory that holds it \\({path}\\)"):
        tools.verify_checkpoint(os.path.join(path, "manifest.json"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=f"^no checkpoint in {tmp_path / 'empty'}$"):
        tools.verify_checkpoint(str(tmp_path / "empty"))


def test_export_writes_the_masters_in_hugging_face_layout_cast_once(saved, tmp_path, capsys):
    save_dir, path, weights, module = saved
    status, text = _run("export", save_dir, str(tmp_path / "fp32"), "--dtype", "fp32")
    assert status == 0 and text == f"exported model weights (fp32) to {tmp_path / 'fp32'}\n"
    assert "not a Hugging Face architecture" in capsys.readouterr().err  # a plain torch module: said so
    out = tmp_path / "fp32"
    index = json.load(open(out / "model.safetensors.index.json"))
    exported = {}
    for file in set(index["weight_map"].values()):
        exported.update(load_file(str(out / file)))
    assert set(exported) == set(module) and index["metadata"]["total_size"] == sum(
        t.numel() * 4 for t in exported.values())
    for name, tensor in exported.items():
        assert tensor.dtype == torch.float32, name
        want = weights[name] if name in weights else module[name].float()
        assert torch.equal(tensor, want.float()), name  # trained weights from the fp32 masters, not the bf16 copy
    assert (out / "tokenizer.json").read_bytes() == b'{"t": 1}'  # the side files go along
    assert not any(name.startswith(("rng_state_", "trainer_state", "manifest")) for name in os.listdir(out))
    assert sorted(os.listdir(tmp_path)) == ["fp32"]  # nothing staged left behind
    tools.export_model(path, str(tmp_path / "as_saved"))
    as_saved = load_file(str(tmp_path / "as_saved" / index["weight_map"]["fc1.weight"]))
    assert as_saved["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(as_saved["fc1.weight"], weights["fc1.weight"].bfloat16())
    small = tools.export_model(path, str(tmp_path / "small"), dtype="fp32", max_file_bytes=64)
    small_index = json.load(open(os.path.join(small, "model.safetensors.index.json")))
    assert len(set(small_index["weight_map"].values())) > 1 and small_index["weight_map"].keys() == exported.keys()
    with pytest.raises(CheckpointError, match=f"export target {tmp_path / 'fp32'} exists and is not empty"):
        tools.export_model(path, str(tmp_path / "fp32"))
    with pytest.raises(CheckpointError, match="unknown dtype 'float128'"):
        tools.export_model(path, str(tmp_path / "bad"), dtype="float128")
    assert tools.export_model(path, str(tmp_path / "f16"), dtype="float16")  # torch's own names too


def test_the_read_only_helpers_find_the_latest_and_the_intact_checkpoints(saved, tmp_path):
    save_dir, path, _, _ = saved
    assert tools.latest_step(save_dir) == (path, 2)
    assert tools.latest_step(str(tmp_path)) is None
    assert tools.saved_config(path)["zero_optimization"]["stage"] == 2
    assert tools.saved_config(str(tmp_path)) is None
    copy = tmp_path / "copy"
    shutil.copytree(save_dir, copy)
    shutil.copytree(path, copy / "older")
    state = json.load(open(copy / "older" / "trainer_state.json"))
    state["global_steps"] = 1
    json.dump(state, open(copy / "older" / "trainer_state.json", "w"))
    shutil.copytree(path, copy / "cut")
    os.truncate(copy / "cut" / "rng_state_0.json", 1)  # not intact: a file shorter than listed
    shutil.copytree(path, copy / "x.zerotrain-tmp-1")
    # "older"'s trainer state changed size: the manifest's size no longer matches, so it is not intact either
    assert tools.intact_tags(str(copy)) == [("global_step2", 2)]
    state_file = copy / "older" / "trainer_state.json"
    manifest = json.load(open(copy / "older" / "manifest.json"))
    manifest["files"]["trainer_state.json"]["size"] = state_file.stat().st_size
    json.dump(manifest, open(copy / "older" / "manifest.json", "w"))
    assert tools.intact_tags(str(copy)) == [("global_step2", 2), ("older", 1)]  # the newest step first
    assert tools.intact_tags(str(tmp_path / "missing")) == []
    assert not tools.is_hugging_face_model(path)


def test_an_exported_hugging_face_config_names_the_dtype_it_was_cast_to(saved, tmp_path):
    """A checkpoint of a Hugging Face model carries config.json and generation_config.json: the export copies them,
    naming the cast dtype in config.json's own spelling (`dtype`, or an older config's `torch_dtype`)."""
    _, path, weights, _ = saved
    hf = tmp_path / "hf"
    shutil.copytree(path, hf)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32", "architectures": ["X"]}))
    (hf / "generation_config.json").write_text(json.dumps({"max_length": 7}))
    for dtype, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        out = tools.export_model(str(hf), str(tmp_path / dtype), dtype=dtype)
        assert json.load(open(os.path.join(out, "config.json"))) == {"model_type": "llama", "dtype": name,
                                                                    "architectures": ["X"]}
        assert json.load(open(os.path.join(out, "generation_config.json"))) == {"max_length": 7}
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        tensor = load_file(os.path.join(out, index["weight_map"]["fc1.weight"]))["fc1.weight"]
        assert tensor.dtype == getattr(torch, name) and torch.equal(tensor, weights["fc1.weight"].to(tensor.dtype))
        assert tools.is_hugging_face_model(out)
    as_saved = tools.export_model(str(hf), str(tmp_path / "as_saved"))
    assert json.load(open(os.path.join(as_saved, "config.json")))["dtype"] == "float32"  # not cast: as it was
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    legacy = tools.export_model(str(hf), str(tmp_path / "legacy"), dtype="bf16")
    assert json.load(open(os.path.join(legacy, "config.json"))) == {"model_type": "llama", "torch_dtype": "bfloat16"}
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no dtype at all: today's spelling
    plain = tools.export_model(str(hf), str(tmp_path / "plain"), dtype="fp16")
    assert json.load(open(os.path.join(plain, "config.json"))) == {"model_type": "llama", "dtype": "float16"}


def test_import_is_a_ckpt_tool_and_a_directory_that_is_no_deepspeed_checkpoint_is_one_line(saved, tmp_path, capsys):
    _, path, _, _ = saved
    status, text = _run("import", path, str(tmp_path / "out"))  # a zerotrain checkpoint is no DeepSpeed one
    err = capsys.readouterr().err
    assert status == 1 and text == "" and err.startswith("zerotrain ckpt import: ") and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "out" / "latest")
    with pytest.raises(SystemExit):
        _parse("import", "--help")
    assert "DS_DIR OUT" in capsys.readouterr().out


def test_merge_lora_takes_an_optional_adapter_directory(capsys):
    assert _parse("export", "d", "o").merge_lora is None
    assert _parse("export", "d", "o", "--merge-lora").merge_lora == ""  # the checkpoint's own adapter
    assert _parse("export", "d", "o", "--merge-lora", "adapter").merge_lora == "adapter"
    with pytest.raises(SystemExit):
        _parse("export", "--help")
    assert "--merge-lora [ADAPTER_DIR]" in capsys.readouterr().out


def test_a_deepspeed_export_needs_its_world_size_and_takes_no_cast(saved, tmp_path, capsys):
    _, path, _, _ = saved
    assert _parse("export", "d", "o", "--format", "deepspeed", "--world-size", "2", "--stage", "1").stage == 1
    for extra in ([], ["--world-size", "2", "--dtype", "bf16"], ["--world-size", "2", "--merge-lora"]):
        assert _run("export", path, str(tmp_path / "ds"), "--format", "deepspeed", *extra)[0] == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("zerotrain ckpt export: --format deepspeed needs --world-size N") and \
            len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "ds")


def test_export_merge_lora_folds_a_peft_adapter_as_peft_merges_it(saved, tmp_path, capsys):
    """`ckpt export --merge-lora ADAPTER` of a plain (not adapters-only) checkpoint: the trained fp32 weights with a
    PEFT adapter folded in, equal to PEFT's own `merge_and_unload` of the same weights and adapter."""
    import peft

    from ckpt_common import CkptNet

    save_dir, path, weights, module = saved
    model = CkptNet()
    model.load_state_dict({name: (weights[name] if name in weights else tensor).float()
                           for name, tensor in module.items()})
    torch.manual_seed(3)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["fc1", "fc2"],
                                                      init_lora_weights=False))  # B random too: a real delta
    adapter = tmp_path / "adapter"
    lora.save_pretrained(str(adapter))
    want = {name: tensor.detach().clone() for name, tensor in lora.merge_and_unload().state_dict().items()}
    status, text = _run("export", save_dir, str(tmp_path / "merged"), "--dtype", "fp32", "--merge-lora", str(adapter))
    assert status == 0 and text == (f"exported model weights (fp32, LoRA {adapter} folded in) to "
                                    f"{tmp_path / 'merged'}\n"), text
    capsys.readouterr()
    index = json.load(open(tmp_path / "merged" / "model.safetensors.index.json"))
    exported = {}
    for file in set(index["weight_map"].values()):
        exported.update(load_file(str(tmp_path / "merged" / file)))
    assert set(exported) == set(want)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(exported["fc1.weight"], weights["fc1.weight"])  # the adapter did change fc1


def test_a_deepspeed_export_says_its_own_warnings_in_one_line_and_shows_others_as_python_does(saved, tmp_path,
                                                                                                monkeypatch, capsys):
    """What the export changes or leaves out (ExportWarning) is one `warning:` line; any other warning raised on the
    way (a library's UserWarning, say) is shown as Python shows it: FILE:LINE: Category: message."""
    import warnings

    from zerotrain.checkpoint import deepspeed_export

    _, path, _, _ = saved
    target_config = deepspeed_export._target_config

    def warning_config(*args, **kwargs):
        warnings.warn("a library's own warning", UserWarning)  # the line below this one is named
        line = warning_config.__code__.co_firstlineno + 1
        warnings.warn("the export's own warning", deepspeed_export.ExportWarning)
        warning_config.line = line
        return target_config(*args, **kwargs)

    monkeypatch.setattr(deepspeed_export, "_target_config", warning_config)
    with warnings.catch_warnings(record=True) as shown:  # what Python's warnings.showwarning is handed
        warnings.simplefilter("always")
        status, text = _run("export", path, str(tmp_path / "ds"), "--format", "deepspeed", "--world-size", "2")
    assert status == 0 and text.startswith(f"exported {path} as a DeepSpeed checkpoint for 2 ranks"), text
    err = capsys.readouterr().err
    assert "zerotrain ckpt export: warning: the export's own warning\n" in err
    assert "a library's own warning" not in err  # not made one of the export's own lines
    assert [(w.category, str(w.message), w.filename, w.lineno) for w in shown] == [
        (UserWarning, "a library's own warning", __file__, warning_config.line)]
