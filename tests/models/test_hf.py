"""Hugging Face model directories for `zerotrain train`: missing files named, ZeRO-3 loading from safetensors
slices equal to `from_pretrained`, and a CLI run on local data whose checkpoints `from_pretrained` loads and
which resumes at the exact next sample on another world size."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from models_for_tests import tied_llama_copy

import transformers  # the dev extra has it: a missing install fails, never skips

REPO = Path(__file__).resolve().parents[2]


def _probe(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(5))


# --- missing and bad inputs (in-process) -------------------------------------------------------------------

def test_missing_or_incomplete_model_directories_are_named(tiny_llama_dir, tmp_path, capsys):
    from zerotrain.cli import main
    from zerotrain.models.hf import PRESETS, ModelError, resolve_model

    source = resolve_model(str(tiny_llama_dir))
    assert source.weights_dir == str(Path(tiny_llama_dir).resolve()) and source.config.model_type == "llama"

    def broken(name: str, drop) -> Path:
        copy = tmp_path / name
        shutil.copytree(tiny_llama_dir, copy)
        for pattern in drop:
            for path in copy.glob(pattern):
                path.unlink()
        return copy

    index = json.loads((Path(tiny_llama_dir) / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    cases = {
        "config.json": broken("no_config", ["config.json"]),
        shard: broken("no_shard", [shard]),
        "model.safetensors or model.safetensors.index.json is missing": broken("no_weights", ["model*"]),
        "tokenizer.json or tokenizer_config.json is missing": broken("no_tokenizer", ["tokenizer*"]),
    }
    for expected, directory in cases.items():
        with pytest.raises(ModelError, match=expected.replace(".", r"\.")):
            resolve_model(str(directory))
    with pytest.raises(ModelError, match="presets: " + ", ".join(PRESETS)):
        resolve_model("no-such-model")
    # A model type transformers does not ship (its code would come from the hub) is refused, not fetched.
    remote = broken("remote", [])
    (remote / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {}}))
    with pytest.raises(ModelError, match="my_custom_lm"):
        resolve_model(str(remote))
    with pytest.raises(ModelError, match="--model-config needs --tokenizer"):
        resolve_model(None, model_config=str(Path(tiny_llama_dir) / "config.json"))
    # The command refuses before any process starts, naming the file (exit status 2).
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    assert main(["train", "--config", str(config), "--nproc", "2", "--model", str(cases[shard])]) == 2
    assert shard in capsys.readouterr().err
    # tokenizer_config.json without tokenizer.json (a fast tokenizer with nothing to build it from): one line naming
    # the file, before any process starts (it was transformers' paragraph and a launcher trace from the ranks)
    no_json = broken("no_tokenizer_json", ["tokenizer.json"])
    assert main(["train", "--config", str(config), "--nproc", "2", "--model", str(no_json)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerotrain: error: {no_json.resolve()} has no tokenizer.json") and err.count("\n") == 1, err
    assert main(["train", "--config", str(config), "--model", str(tiny_llama_dir), "--data",
                 str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err


def test_workers_get_the_model_and_data_arguments(tmp_path):
    """`--nproc N` re-runs `train` in each worker: the model/data options survive the round trip."""
    from zerotrain.cli import build_parser
    from zerotrain.train.command import worker_argv

    argv = ["train", "--config", "c.json", "--nproc", "2", "--model", "m", "--tokenizer", "t", "--data", "a.jsonl",
            "b.txt", "--eval-data", "e.jsonl", "--text-field", "body", "--no-packing", "--num-proc", "3",
            "--skip-bad-records", "--add-tokens", "<|a|>", "<|b|>", "--seq-len", "64"]
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(worker_argv(args))
    for key in ("model", "tokenizer", "text_field", "no_packing", "num_proc", "skip_bad_records", "add_tokens",
                "seq_len"):
        assert getattr(again, key) == getattr(args, key), key
    assert again.data == [os.path.abspath("a.jsonl"), os.path.abspath("b.txt")]
    assert again.eval_data == [os.path.abspath("e.jsonl")]


# --- one world-2 launch: ZeRO-3 loading == from_pretrained, and `zerotrain train` on local data ------------------

def _load_at_zero3(cases: list[tuple[str, list]], vocab: int, tmp: str) -> dict:
    """Each (directory, tokens to add) as `zerotrain train` loads it at ZeRO-3: logits, weights, partitioning."""
    from zerotrain.run.model import load_weights, model_engine
    from zerotrain.models.hf import grow_vocab, load_tokenizer, resolve_model
    from zerotrain.zero.stage3.partition import ZeroParameter

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 0}
    out = {}
    for directory, tokens in cases:
        source = resolve_model(directory)
        old_vocab = grow_vocab(source, load_tokenizer(source), tokens)
        engine, model = model_engine(source, config)
        # every parameter a released shard (a one-element placeholder, no full copy) before the load
        partitioned = all(isinstance(p, ZeroParameter) and not p._zero.gathered
                          and p.data.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())
        load_weights(engine, source, model, old_vocab, tmp, seed=11)
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=_probe(vocab)).logits
        out[(directory, len(tokens))] = {
            "logits": logits, "partitioned": partitioned, "weights": engine.full_state_dict(),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight, "left": os.listdir(tmp)}
    return out


def _load_then_train(directories: list[str], vocab: int, cwd: str, argv: list[str], *more: list[str]) -> dict:
    """In each rank of a run_distributed launch: the loads, then the `train` command as a torchrun worker runs it
    (RANK is set, so `main` trains in this process; the launcher itself is covered by the demo's tests), then
    the `more` commands one after the other in the same process."""
    from zerotrain.cli import main

    loaded = _load_at_zero3(directories, vocab, os.path.join(cwd, "overlays")) if directories else {}
    os.chdir(cwd)
    os.environ["ZEROTRAIN_DATA_CACHE"] = os.path.join(cwd, "cache")
    status = main(["train", *argv])
    return {"loaded": loaded, "status": status, "more": [main(["train", *other]) for other in more]}


def _losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def test_zero3_world2_loads_like_from_pretrained_and_train_on_jsonl_resumes_on_one_rank(tiny_llama_dir, tmp_path,
                                                                                         capsys, monkeypatch):
    from zerotrain.cli import main
    from zerotrain.models.tiny_llama import write_chat_jsonl

    sharded = Path(tiny_llama_dir)
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    tied = tied_llama_copy(sharded, tmp_path / "tied")
    vocab = transformers.AutoConfig.from_pretrained(sharded).vocab_size
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", n=48)
    one = tmp_path / "one.jsonl"  # an eval set of one sample: less than a micro-batch per rank, evaluated all the same
    one.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n"}) + "\n")
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    (tmp_path / "w2.json").write_text(json.dumps(base))
    (tmp_path / "w1.json").write_text(json.dumps({**base, "gradient_accumulation_steps": 2}))  # same global batch
    common = ["--model", str(sharded), "--data", str(chat), "--seq-len", "64", "--steps", "4"]
    first = ["--config", "w2.json", *common, "--eval-data", str(one), "--save-dir", "ckpt", "--save-every", "2",
             "--log-dir", "full"]
    (tmp_path / "overlays").mkdir()
    new = ["<|tool|>", "<|think|>", "<|x|>"]
    cases = [(str(sharded), []), (str(sharded), new), (str(tied), new[:2])]
    results = run_distributed(_load_then_train, 2, cases, vocab, str(tmp_path), first)
    assert [r["status"] for r in results] == [0, 0]

    # Loading: each rank read its shard ranges of the safetensors files; the logits are from_pretrained's. With
    # tokens added, embedding and (tied or untied) head grew as transformers' resize_token_embeddings grows them.
    for directory, tokens in cases:
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        if tokens:
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
            tokenizer.add_tokens(tokens, special_tokens=True)
            torch.manual_seed(11)
            reference.resize_token_embeddings(len(tokenizer))
            assert reference.get_input_embeddings().weight.shape[0] == vocab + len(tokens)
        with torch.no_grad():
            want = reference(input_ids=_probe(vocab)).logits
        for rank, result in enumerate(results):
            got = result["loaded"][(directory, len(tokens))]
            assert got["partitioned"], f"rank {rank}: every parameter partitioned right after construction"
            assert got["tied"] == (directory == str(tied)) and got["left"] == [], "tied as saved; overlay removed"
            torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
        weights = results[0]["loaded"][(directory, len(tokens))]["weights"]
        assert {name for name, _ in reference.named_parameters()} <= set(weights)
        for name, tensor in reference.state_dict().items():
            if name in weights:  # parameters (a tied head under both names), not buffers
                torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)

    # The checkpoint directory is a Hugging Face model directory: model + tokenizer, same as the source.
    step4 = tmp_path / "ckpt" / "global_step4"
    trained = transformers.AutoModelForCausalLM.from_pretrained(step4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(step4)
    original = transformers.AutoTokenizer.from_pretrained(sharded)
    assert tokenizer.get_vocab() == original.get_vocab() and tokenizer.chat_template == original.chat_template
    before = transformers.AutoModelForCausalLM.from_pretrained(sharded)
    assert not torch.equal(trained.model.embed_tokens.weight, before.model.embed_tokens.weight), "it trained"
    assert set(_losses(tmp_path / "full")) == {1, 2, 3, 4}
    assert "eval_loss" in json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[-1])

    # Resume from step 2 on one rank (accumulating 2 micro-batches: the same global batch): steps 3-4 draw the
    # same samples and give the same losses and weights.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "global_step2", resumed / "global_step2")
    (resumed / "latest").write_text("global_step2")
    again = ["--config", "w1.json", *common, "--save-dir", "resumed", "--resume", "--log-dir", "again"]
    # then, in the same process: --resume --steps 3 on the step-4 checkpoint trains nothing, says so, exit status 0
    # (it used to print "trained 0 steps ... final loss nan"); --data with --val-fraction and no --eval-data
    # evaluates on the held-out tail (it used to evaluate nothing, silently)
    behind = ["--config", "w1.json", *common[:-1], "3", "--save-dir", "resumed", "--resume", "--log-dir", "behind"]
    held_out = ["--config", "w1.json", *common[:-1], "2", "--val-fraction", "0.25", "--eval-interval", "1",
                "--no-save", "--log-dir", "held_out"]
    # a real-world config without an optimizer block (LLaMA-Factory's ZeRO-2): AdamW and the linear schedule from the
    # flags, as the HF Trainer builds them (it used to build a forward-only engine: NoOptimizerError at the first
    # backward), the same steps as the flags alone make at ZeRO-2
    real = Path(__file__).parents[1] / "config" / "real_world" / "llamafactory_z2.json"
    adamw = ["--learning-rate", "3e-3", "--weight-decay", "0.01", "--per-device-train-batch-size", "2", "--no-save"]
    no_optimizer = ["--deepspeed", str(real), *common[:-1], "3", *adamw, "--log-dir", "no_optimizer"]
    flags_alone = ["--zero-stage", "2", *common[:-1], "3", *adamw, "--log-dir", "flags_alone"]
    result = run_distributed(_load_then_train, 1, [], vocab, str(tmp_path), again, behind, held_out, no_optimizer,
                             flags_alone)[0]
    assert result["status"] == 0 and result["more"] == [0, 0, 0, 0]
    from_file, from_flags = _losses(tmp_path / "no_optimizer"), _losses(tmp_path / "flags_alone")
    assert sorted(from_file) == [1, 2, 3], from_file
    for step in (1, 2, 3):
        assert from_file[step] == pytest.approx(from_flags[step], rel=1e-6), (step, from_file, from_flags)
    assert not (tmp_path / "behind" / "metrics.jsonl").exists() and (resumed / "latest").read_text() == "global_step4"
    assert [("eval_loss" in r, r["step"]) for r in map(json.loads, (tmp_path / "held_out" / "metrics.jsonl")
                                                         .read_text().splitlines())] == [(True, 1), (True, 2)]
    capsys.readouterr()
    # the same before any process starts: the launcher reads the checkpoint's step
    monkeypatch.chdir(tmp_path)
    assert main(["train", *behind[:-2], "--nproc", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "nothing to train: --steps 2" in out and "global_step4 is at step 4" in out, out
    full, second = _losses(tmp_path / "full"), _losses(tmp_path / "again")
    assert sorted(second) == [3, 4]
    for step in (3, 4):
        assert second[step] == pytest.approx(full[step], rel=1e-5), step
    final = transformers.AutoModelForCausalLM.from_pretrained(resumed / "global_step4")
    for (name, got), want in zip(final.named_parameters(), trained.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
