"""`zerotrain train-embedding`'s command function in the pytest process (issue #48: the fast covering tests of
`zerotrain/embedding/command.py`'s mutation run; the launches at two ranks are tests/embedding/test_resume.py's and
test_export.py's): its options and the workers' argv, the config file's `embedding` block, the refusals before any
engine, and whole runs at a world of one (the first loss against plain PyTorch, the held-out evaluation against
`retrieval_metrics` of the saved weights, checkpoints, the export, a resume over epochs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.embedding.test_resume import _model_dir


def _parse(*argv: str):
    from zerotrain.cli import build_parser

    return build_parser().parse_args(["train-embedding", "--model", "m", "--data", "d", *argv])


def test_options_defaults_and_the_workers_argv_parse_back_to_the_same_run():
    """The defaults, and every option a worker of `--nproc N`
    needs carried by `worker_argv` with its value, flags as flags."""
    from zerotrain.embedding.command import worker_argv

    defaults = _parse()
    assert (defaults.eval_stdlib, defaults.epochs, defaults.steps, defaults.negatives, defaults.max_length,
            defaults.pooling, defaults.scale, defaults.matryoshka_dims, defaults.loss_chunk_size, defaults.seed,
            defaults.nproc, defaults.max_restarts, defaults.stop_timeout) == (0, 1, None, None, 256, None, 20.0,
                                                                             None, None, None, 1, 0, 300)
    # --max-steps as the HF Trainer's max_steps: its default -1 (which scripts pass) or 0 is not set: the epochs count
    assert _parse("--max_steps", "-1").steps is None and _parse("--max-steps", "0").steps is None
    assert "--max-steps" not in " ".join(worker_argv(_parse("--max-steps", "-1")))
    # the training flags are left unset (the config's defaults apply: test_train_flags.py); the rest by value
    assert worker_argv(defaults) == ["train-embedding", "--data", "d", "--model=m", "--eval-stdlib=0", "--epochs=1",
                                     "--max-length=256", "--scale=20.0"]
    given = _parse("--data", "a.jsonl", "b.jsonl", "--config", "c.json", "--eval-stdlib", "7", "--metrics", "m.jsonl",
                   "--log-dir", "logs", "--max-steps", "9", "--epochs", "3", "--lr", "0.001", "--micro-batch", "4",
                   "--accumulation", "2", "--log-every", "3", "--negatives", "2", "--max-length", "64",
                   "--pooling", "max", "--scale", "12.5", "--matryoshka-dims", "16,8", "--loss-chunk-size", "5",
                   "--seed", "11", "--save-dir", "ck", "--save-every", "4", "--export", "out", "--resume",
                   "--resume-from-checkpoint", "ck/global_step4", "--bf16", "--gradient-checkpointing",
                   "--zero-stage", "2", "--warmup-steps", "3", "--weight-decay", "0.1", "--max-grad-norm", "0.5",
                   "--save-total-limit", "2", "--per-device-eval-batch-size", "5", "--nproc", "2",
                   "--max-restarts", "1")
    assert (given.data, given.steps, given.epochs, given.learning_rate, given.per_device_train_batch_size,
            given.gradient_accumulation_steps, given.logging_steps, given.save_dir, given.save_every, given.nproc) == (
        ["a.jsonl", "b.jsonl"], 9, 3.0, 1e-3, 4, 2, 3, "ck", 4, 2)
    argv = worker_argv(given)
    assert argv[:5] == ["train-embedding", "--data", "a.jsonl", "b.jsonl", "--model=m"]
    assert "--nproc" not in " ".join(argv)  # a worker is one rank
    from zerotrain.cli import build_parser
    back = build_parser().parse_args(argv)
    launcher = {"nproc", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                "rdzv_id", "rdzv_conf", "max_restarts", "stop_timeout"}
    assert {k: v for k, v in vars(back).items() if k not in launcher} == {
        k: v for k, v in vars(given).items() if k not in launcher}
    assert (back.nproc, back.max_restarts) == (1, 0) and back.resume and back.bf16 and not back.fp16


def _cfg(tmp_path: Path, block) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"embedding": block}))
    return str(path)


def test_the_config_files_embedding_block_is_checked_and_never_reaches_the_engine(tmp_path, capsys):
    """`embedding` must be an object of known keys with positive integers: each bad one is one line naming the key
    and the file (status 2); a good one is taken out of the engine's config (`--print-config` prints none)."""
    from zerotrain.cli import main

    for block, message in (([1], "'embedding' must be an object"),
                           ({"loss_chunk": 2}, "unknown key 'embedding.loss_chunk'; valid keys here: loss_chunk_size"),
                           ({"loss_chunk_size": 0}, "'embedding.loss_chunk_size' must be a positive integer, got 0"),
                           ({"loss_chunk_size": True}, "'embedding.loss_chunk_size' must be a positive integer, got "
                                                       "True"),
                           ({"loss_chunk_size": 2.0}, "'embedding.loss_chunk_size' must be a positive integer, got "
                                                      "2.0")):
        path = _cfg(tmp_path, block)
        assert main(["train-embedding", "--model", "m", "--data", "d", "--config", path, "--print-config"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"zerotrain: error: {path}: {message}"], (block, err)
    path = _cfg(tmp_path, {"loss_chunk_size": 1})  # the smallest accepted
    assert main(["train-embedding", "--model", "m", "--data", "d", "--config", path, "--print-config"]) == 0
    assert "embedding" not in json.loads(capsys.readouterr().out)


def test_epochs_alone_lay_the_schedule_over_the_steps_the_seeds_order_makes(tmp_path, capsys):
    """With duplicate texts an epoch's batch count depends on the order (no text twice in a batch): the six pairs
    below make 5 batches of 2 over two epochs in seed 0's order, 6 in seed 1's. Without --seed the count is seed 0's
    (the default), as the run's order is."""
    from zerotrain.cli import main

    data = tmp_path / "dup.jsonl"
    data.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i % 3}"}) + "\n" for i in range(6)))
    steps = {}
    for seed in (None, "0", "1"):
        argv = ["train-embedding", "--model", "m", "--data", str(data), "--micro-batch", "2", "--num-train-epochs",
                "2", "--lr-scheduler-type", "linear", "--print-config"] + (["--seed", seed] if seed else [])
        assert main(argv) == 0
        steps[seed] = json.loads(capsys.readouterr().out)["scheduler"]["params"]["num_training_steps"]
    assert steps == {None: 5, "0": 5, "1": 6}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("embedding_command"))


def _pairs(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"query": f"how do I do task {i}?", "positive": f"Call tool number {i}.",
                                        "negatives": [f"A note on {i}.", f"Nothing about {i * 7}."]}) + "\n"
                            for i in range(n)))
    return path


def test_bad_inputs_are_refused_in_one_line_before_any_engine(tmp_path, model_dir, capsys):
    """Each refusal of the command function names its flag (status 2, nothing trained, no save directory made);
    the boundary values next to each are accepted (--print-config would not reach these checks)."""
    from zerotrain.cli import main

    data = _pairs(tmp_path / "pairs.jsonl", 4)
    no_config = tmp_path / "empty"
    no_config.mkdir()
    bad_pooling = tmp_path / "st"
    bad_pooling.mkdir()
    (bad_pooling / "config.json").write_text((model_dir / "config.json").read_text())
    (bad_pooling / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                           "type": "sentence_transformers.models.Pooling"}]))
    (bad_pooling / "1_Pooling").mkdir()
    (bad_pooling / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16}))
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text(json.dumps({"query": "q"}) + "\n")
    save = tmp_path / "save"
    base = ["--model", str(model_dir), "--data", str(data), "--max-steps", "1"]
    for argv, message in (
            (["--model", str(no_config)], f"--model {no_config}: no config.json (a local Hugging Face or "
                                          "sentence-transformers directory is needed; nothing is downloaded)"),
            (["--resume"], "--resume reads the latest checkpoint of --save-dir: give --save-dir"),
            (["--save-dir", str(save), "--save-every", "0"], "--save-every must be >= 1, got 0"),
            (["--num-train-epochs", "1.5"], "--num-train-epochs: train-embedding runs whole epochs, got 1.5 "
                                            "(--max-steps sets any number of steps)"),
            (["--num-train-epochs", "-1"], "--num-train-epochs: train-embedding runs whole epochs, got -1"),
            (["--per-device-eval-batch-size", "0"], "--per-device-eval-batch-size must be >= 1, got 0"),
            (["--loss-chunk-size", "0"], "--loss-chunk-size must be >= 1, got 0"),
            (["--matryoshka-dims", "16,x"], "--matryoshka-dims '16,x': give comma-separated integers"),
            (["--model", str(bad_pooling)], f"--model {bad_pooling}: "),
            (["--data", str(bad_data)], f"--data: bad pair records: {bad_data}, line 1: no 'positive' field"),
            (["--micro-batch", "5"], "--data: 4 pairs cannot fill one batch of 5 queries")):
        args = base + argv
        assert main(["train-embedding", *args]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"zerotrain: error: {message}"), (argv, err)
        assert not save.exists(), argv


def _library(root: Path) -> Path:
    """A stand-in for the standard library: 30 modules of two documented functions (the held-out split's pairs)."""
    for i in range(30):
        (root / f"m{i:02d}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"m{i:02d}.py").write_text("".join(
            f'def task_{i}_{k}(items):\n    """Do task {i} the {"fast" if k else "slow"} way over the items."""\n'
            f'    return [item * {i + k} for item in items]\n\n\n' for k in range(2)))
    return root


def test_a_run_trains_evaluates_saves_and_exports_what_its_options_say_and_resumes_over_epochs(
        tmp_path, model_dir, monkeypatch, capsys, world_of_one):
    """One world-of-one run with most options set: the first step's loss is plain PyTorch's InfoNCE (CLS pooling,
    scale 10, Matryoshka 16 + 8, hard negatives) over the first global batch the seed gives; the evaluations before
    and after training are `retrieval_metrics` of the directory's and of the exported weights over the held-out
    pairs; a checkpoint every step; the export is the last checkpoint's weights with its pooling. Then `--resume`
    with `--num-train-epochs 2` trains the second epoch's two batches, and a resume with nothing left trains none
    (no summary line; `--num-train-epochs 0` is accepted beside `--max-steps`)."""
    from transformers import AutoModel, AutoTokenizer

    from tests.embedding.test_resume import _records, _weights
    from zerotrain.cli import main
    from zerotrain.embedding import Pooling, read_pooling
    from zerotrain.embedding.data import global_batches, load_pairs, tokenize_micro_batch
    from zerotrain.embedding.export import encode
    from zerotrain.embedding.retrieval import retrieval_metrics, stdlib_pairs

    library = _library(tmp_path / "lib")
    monkeypatch.setattr("zerotrain.embedding.retrieval.stdlib_dir", lambda: library)
    data, save, log, out = _pairs(tmp_path / "pairs.jsonl", 8), tmp_path / "save", tmp_path / "log", tmp_path / "st"
    common = ["--model", str(model_dir), "--data", str(data), "--micro-batch", "2", "--accumulation", "2",
              "--learning-rate", "1e-3", "--pooling", "cls", "--scale", "10", "--matryoshka-dims", "16,8",
              "--max-length", "16", "--seed", "3", "--output-dir", str(save), "--log-dir", str(log),
              "--logging-steps", "1"]
    assert main(["train-embedding", *common, "--config", _cfg(tmp_path, {"loss_chunk_size": 3}), "--max-steps", "2",
                 "--eval-stdlib", "5", "--per-device-eval-batch-size", "3", "--metrics", str(tmp_path / "m.jsonl"),
                 "--save-every", "1", "--export", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (f"zerotrain: train-embedding {model_dir.name}: 8 pairs, 2 hard negatives per query, pooling cls; one "
            "contrastive batch = 4 queries (1 ranks x 2 accumulation x 2 micro), ZeRO stage 0, loss in tiles of 3"
            ) in printed, printed
    records = _records(log)
    assert sorted(records) == [0, 1, 2]

    tokenizer, start = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir)
    pairs = load_pairs([data])
    batch = tokenize_micro_batch(pairs, next(iter(global_batches(pairs, 4, seed=3, epoch=0))), tokenizer, 16)
    with torch.no_grad():
        queries = start(**batch.features).last_hidden_state[:, 0]
        candidates = start(**batch.passage_features).last_hidden_state[:, 0]
    assert candidates.shape[0] == 12  # 4 positives, 8 hard negatives
    want = sum(F.cross_entropy(F.normalize(queries[:, :d], dim=-1) @ F.normalize(candidates[:, :d], dim=-1).T * 10.0,
                               torch.arange(4)) for d in (16, 8))
    assert records[1]["loss"] == pytest.approx(float(want), rel=1e-5)
    assert json.loads(printed.strip().splitlines()[-1]) == {"steps": 2, "first_loss": records[1]["loss"],
                                                             "last_loss": records[2]["loss"]}

    held_out = stdlib_pairs(max_held_out=5)[1][:5]
    assert len(held_out) == 5
    exported = AutoModel.from_pretrained(out)
    final = _weights(save)
    assert (save / "latest").read_text().strip() == "global_step2" and (save / "global_step1").is_dir()
    assert read_pooling(out).mode == "cls"
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)
    evaluations = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(e["when"], e["step"], e["queries"], e["batch_size"]) for e in evaluations] == [
        ("before", 0, 5, 3), ("after", 2, 5, 3)]
    for evaluation, model in zip(evaluations, (start, exported)):
        want = retrieval_metrics(encode(model, tokenizer, [p["query"] for p in held_out], Pooling("cls"), max_length=16),
                                 encode(model, tokenizer, [p["positive"] for p in held_out], Pooling("cls"),
                                        max_length=16))
        assert {k: evaluation[k] for k in want} == pytest.approx(want, abs=1e-6)
        record = records[evaluation["step"]]
        assert (record["recall_at_1"], record["recall_at_10"], record["mrr_at_10"]) == pytest.approx(
            (want["recall@1"], want["recall@10"], want["mrr@10"]), abs=1e-6)

    # the second epoch: two more steps (2 of 4), nothing evaluated or exported unasked
    assert main(["train-embedding", *common, "--resume", "--num-train-epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert (f"zerotrain: resumed from {save / 'global_step2'} at step 2: epoch 1, batch 0 next (8 queries consumed)"
            in printed), printed
    assert sorted(_records(log)) == [0, 1, 2, 3, 4] and "recall_at_1" not in _records(log)[4]
    assert json.loads(printed.strip().splitlines()[-1])["steps"] == 2  # this run's
    # nothing left: no step, no summary
    assert main(["train-embedding", *common, "--resume", "--max-steps", "4", "--num-train-epochs", "0"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "first_loss" not in printed, printed
    assert sorted(_records(log)) == [0, 1, 2, 3, 4]
