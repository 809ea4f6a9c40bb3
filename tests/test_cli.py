"""The `zerotrain` command and the Trainer loop behind it."""
import io
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from zerotrain.cli import main
from zerotrain.data import TokenBlockDataset, load_stdlib_corpus
from zerotrain.models import GPT, GPTConfig
from zerotrain.trainer import Trainer
from zerotrain.topology import Topology
from zerotrain.training_engine import TrainingEngine

REPO = Path(__file__).resolve().parent.parent


# -- a stand-in engine: the public engine API over a plain model and torch optimizer ----------

class StandInEngine(TrainingEngine):
    """Implements the slice of the engine API the Trainer uses, single process, no sharding (the rest: the
    `TrainingEngine` Protocol's defaults)."""

    def __init__(self, model, micro_batch=2, accumulation=2, lr=1e-3):
        self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self._micro, self._gas = micro_batch, accumulation
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.config = SimpleNamespace(steps_per_print=2, seed=None, precision="fp32",
                                      zero_optimization=SimpleNamespace(stage=0))
        self.topology = Topology(rank=0, world_size=1, dp_group=None, dp_rank=0, dp_size=1, device=torch.device("cpu"))
        self.calls = []

    def __call__(self, x, y):
        self.calls.append("forward")
        return self.module(x, y)

    def backward(self, loss):
        self.calls.append("backward")
        (loss / self._gas).backward()

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self._gas == 0

    def step(self):
        self.calls.append("step")
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def train_micro_batch_size_per_gpu(self):
        return self._micro

    def gradient_accumulation_steps(self):
        return self._gas

    def train_batch_size(self):
        return self._micro * self._gas

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


def _loader(micro_batch, n_blocks=6, seq=16):
    tokens = load_stdlib_corpus(max_bytes=n_blocks * seq + 1)
    return torch.utils.data.DataLoader(TokenBlockDataset(tokens, seq), batch_size=micro_batch)


def _engine():
    torch.manual_seed(0)
    return StandInEngine(GPT(GPTConfig.preset("tiny")))


def test_trainer_runs_accumulation_and_writes_metrics(tmp_path):
    engine = _engine()
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    trainer = Trainer(engine, _loader(2), total_steps=5, eval_data=_loader(2, n_blocks=4),
                      log_dir=tmp_path, console=console)
    summary = trainer.train()

    # 5 steps x 2 micro-steps, each forward/backward/step (the 3-batch loader wraps around),
    # then the final evaluation: forward only, over the 2 eval batches.
    assert engine.calls == ["forward", "backward", "step"] * 10 + ["forward"] * 2
    assert engine.global_steps == 5
    assert summary.steps == 5
    assert summary.tokens == 5 * 2 * 2 * 16
    assert summary.mean_tokens_per_s > 0
    assert summary.final_eval_loss is not None

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert set(r) >= {"step", "loss", "lr", "tokens_per_s", "elapsed_s"}
        assert r["lr"] == pytest.approx(1e-3)
    assert records[-1]["loss"] == pytest.approx(summary.final_loss)
    assert "eval_loss" in records[-1]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5

    # Not a terminal: a plain line every steps_per_print (2) steps and at the end, then the summary.
    text = out.getvalue()
    assert "step 2/5" in text and "step 4/5" in text and "step 5/5" in text
    assert "step 3/5" not in text
    assert "final loss" in text
    # eval_batches (--eval-batches): at most that many micro-batches per rank, their mean (one rank here)
    engine.calls.clear()
    trainer.eval_batches = 1
    one = trainer.evaluate()
    first = next(iter(_loader(2, n_blocks=4)))
    assert engine.calls == ["forward"] and one == pytest.approx(float(trainer._forward(first)[0].detach()))


def test_trainer_loss_is_mean_over_micro_steps():
    engine = _engine()
    trainer = Trainer(engine, _loader(2), total_steps=1, console=Console(file=io.StringIO()))
    # Recompute the two micro-batch losses of step 1 with the initial weights.
    reference = _engine().module
    batches = iter(_loader(2))
    expected = sum(reference(*next(batches))[1].item() for _ in range(2)) / 2
    loss, lr, tokens = trainer.train_step()
    assert loss == pytest.approx(expected, rel=1e-5)
    assert tokens == 2 * 2 * 16


def test_trainer_resumes_from_engine_step_count():
    engine = _engine()
    engine.global_steps = 3
    summary = Trainer(engine, _loader(2), total_steps=4, console=Console(file=io.StringIO())).train()
    assert summary.steps == 1 and engine.global_steps == 4


# -- the command ------------------------------------------------------------------------------

def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--config", "--nproc", "--model", "--steps", "--seq-len",
                   "--max-corpus-bytes", "--log-dir", "--seed", "--master-port",
                   "--save-dir", "--save-every", "--no-save", "--resume", "--memory-timeline",
                   "--max-steps", "--num-train-epochs", "--learning-rate", "--per-device-train-batch-size",
                   "--deepspeed", "--output-dir", "--save-steps", "--eval-steps", "--print-config"):
        assert option in text
    # each option's default said once: not "Default: small (default: None)", no "(default: False)" on a flag
    blocks = [block for block in text.split("\n  -")[1:]]
    assert all(block.lower().count("default") <= 1 for block in blocks), \
        [block for block in blocks if block.lower().count("default") > 1]
    assert "(default: None)" not in text and "(default: False)" not in text and "default 50 when" in text
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "train" in text and "ckpt" in text
    with pytest.raises(SystemExit) as exc:
        main(["ckpt", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for tool in ("inspect", "verify", "export"):
        assert tool in text


def test_missing_config_exits_2_naming_the_file(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    code = main(["train", "--config", str(missing), "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "nope.json" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_invalid_json_config_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 16,')
    assert main(["train", "--config", str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err


def _engine_available() -> bool:
    try:
        from zerotrain import initialize  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _engine_available(), reason="zerotrain.initialize is not importable yet")
def test_train_tiny_end_to_end(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="40",  # a narrow window, stdout a pipe (not a terminal)
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    from distributed import run_cli

    proc = run_cli(["train", "--config", str(REPO / "examples/zero2.json"), "--nproc", "1", "--model", "tiny",
                    "--steps", "3", "--max-corpus-bytes", "200000", "--log-dir", str(tmp_path), "--save-dir",
                    str(tmp_path / "ckpt"), "--memory-timeline", "0.01"],
                   env=env, timeout=240)  # its own process, forked from the test forkserver (stdout: a file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"checkpoint of step 3 saved: {tmp_path / 'ckpt' / 'global_step3'}" in proc.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step3"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 for r in records)
    assert "final loss" in proc.stdout
    # one record, one line, however narrow COLUMNS is when stdout is no terminal (issue 47: it wrapped at 80)
    import re
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("step ")] == [
        line for line in lines if re.fullmatch(r"step 3/3  epoch \S+  loss \S+  lr \S+  \S+ tok/s  \S+s  "
                                              r"eval_loss \d+\.\d{4}", line)] != []
    assert any(re.fullmatch(r"trained 3 steps .* final loss \S+, \S+ tokens/s, eval loss \d+\.\d{4}", line)
               for line in lines), proc.stdout
    assert not any(re.fullmatch(r"\s*[\d.]+", line) for line in lines), proc.stdout  # no wrapped-off tail
    # --memory-timeline: rank 0's samples next to metrics.jsonl, with the engine's phases and the step count
    lines = [json.loads(line) for line in (tmp_path / "memory_timeline.rank0.jsonl").read_text().splitlines()]
    header, samples = lines[0], lines[1:]
    assert header["rank"] == 0 and header["interval_s"] == 0.01
    assert {s.get("boundary") for s in samples} >= {"forward", "backward", "reduce", "optimizer step", "save"}
    assert all(s["rss"] > 0 for s in samples) and max(s["step"] for s in samples) == 3
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert any(s.get("event") is None and s["phase"] is None for s in samples), "interval samples too"
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "memory_timeline_rank0.png").stat().st_size > 0


def test_workers_get_full_option_names_without_nproc():
    # torch.distributed.run's parser rejects `--nproc` (an ambiguous abbreviation of its
    # --nproc-per-node) even after the script name, so workers must not receive it.
    from zerotrain.cli import build_parser
    from zerotrain.train.command import worker_argv

    args = build_parser().parse_args(
        ["train", "--config", "c.json", "--nproc", "2", "--model", "tiny", "--steps", "7",
         "--log-dir", "runs/x", "--master-port", "29500", "--resume", "--save-every", "3"])
    argv = worker_argv(args)
    assert argv[0] == "train"
    assert "--config=c.json" in argv and "--steps=7" in argv and "--log-dir=runs/x" in argv
    assert "--resume" in argv and "--save-every=3" in argv and "--save-dir=checkpoints" in argv
    assert "--no-save" not in argv
    assert not any(a.startswith(("--nproc", "--master-port")) for a in argv)
    worker = build_parser().parse_args(argv)
    assert worker.steps == 7 and worker.resume and worker.save_every == 3


def test_train_takes_the_multi_node_flags_launch_takes(capsys):
    """`train --nnodes N --node-rank R --master-addr H --master-port P`: torchrun's static rendezvous on every
    node (as `zerotrain launch`), the world N x --nproc in the checked config; bad ones are one line, rc 2."""
    from zerotrain.cli import build_parser
    from zerotrain.command import node_rendezvous
    from zerotrain.train.command import worker_argv

    argv = ["train", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
            "--master-port", "29600", "--per-device-train-batch-size", "3", "--max-steps", "4"]
    args = build_parser().parse_args(argv)
    assert node_rendezvous(args) == ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                                    "--master_port", "29600", "--nproc_per_node", "2"]
    assert node_rendezvous(build_parser().parse_args(["train", "--nproc", "2"]))[0] == "--standalone"
    assert not any(a.startswith(("--nnodes", "--node-rank", "--master")) for a in worker_argv(args))
    assert main([*argv, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 3 * 4  # 2 nodes x 2 ranks
    for bad, says in ((["--nnodes", "2"], "--nnodes > 1 needs --master-addr and --master-port"),
                      (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"],
                       "--node-rank must be in [0, 2)"), (["--nnodes", "0"], "--nnodes must be >= 1")):
        assert main(["train", *bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not _engine_available(), reason="zerotrain.config is not importable yet")
def test_config_error_exits_2_before_launching(capsys, tmp_path):
    bad = tmp_path / "triple.json"
    bad.write_text('{"train_batch_size": 15, "train_micro_batch_size_per_gpu": 4}')
    assert main(["train", "--config", str(bad), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "train_batch_size" in err and "Traceback" not in err


def test_bad_save_options_exit_2(capsys, tmp_path):
    config = str(REPO / "examples/zero2.json")
    assert main(["train", "--config", config, "--save-every", "-1"]) == 2
    assert "--save-every" in capsys.readouterr().err
    assert main(["train", "--config", config, "--resume", "--no-save"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_trainer_saves_every_n_steps_and_after_the_last(tmp_path):
    engine = _engine()
    saved = []
    engine.save_checkpoint = lambda save_dir: saved.append((engine.global_steps, save_dir)) or \
        f"{save_dir}/global_step{engine.global_steps}"
    engine.wait_checkpoint = lambda: saved.append("wait")
    out = io.StringIO()
    summary = Trainer(engine, _loader(2), total_steps=5, save_dir=tmp_path, save_every=2,
                      console=Console(file=out, width=200)).train()
    assert saved == [(2, str(tmp_path)), (4, str(tmp_path)), (5, str(tmp_path)), "wait"]
    assert summary.checkpoint == f"{tmp_path}/global_step5"
    assert f"checkpoint of step 4 saved: {tmp_path}/global_step4" in out.getvalue()


def test_trainer_resumed_engine_skips_consumed_batches():
    # 3 micro-batches per epoch; a resumed engine at step 2 (2 steps x 2 micro-batches = 4 consumed)
    # must draw its next batch at epoch 1, position 1: the 5th batch an uninterrupted run draws.
    fresh = Trainer(_engine(), _loader(2), total_steps=3, console=Console(file=io.StringIO()))
    drawn = [fresh._next_batch()[0] for _ in range(6)]
    engine = _engine()
    engine.global_steps, engine.global_samples = 2, 2 * engine.train_batch_size()
    resumed = Trainer(engine, _loader(2), total_steps=3, console=Console(file=io.StringIO()))
    resumed._seek()
    assert torch.equal(resumed._next_batch()[0], drawn[4])
    assert torch.equal(resumed._next_batch()[0], drawn[5])


def test_trainer_resume_seek_crosses_epochs_of_a_shuffling_sampler_and_of_a_loader_without_a_length():
    # a sampler reshuffled each epoch (set_epoch): a resumed run 2 epochs and 1 batch in draws the batch an
    # uninterrupted run draws there, in that epoch's order; so does a loader with no len() (an iterable, skipped
    # batch by batch), and a resume one sample in (micro-batch 1, one step)
    dataset = TokenBlockDataset(load_stdlib_corpus(max_bytes=6 * 16 + 1), 16)

    def loader(micro: int = 2):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
        return torch.utils.data.DataLoader(dataset, batch_size=micro, sampler=sampler)

    def resumed(engine, data):
        trainer = Trainer(engine, data, total_steps=9, console=Console(file=io.StringIO()))
        trainer._seek()
        return trainer._next_batch()[0]

    fresh = Trainer(_engine(), loader(), total_steps=9, console=Console(file=io.StringIO()))
    drawn = [fresh._next_batch()[0] for _ in range(8)]  # 3 batches an epoch
    assert not torch.equal(torch.cat(drawn[:3]), torch.cat(drawn[3:6]))  # the epochs' orders differ
    engine = _engine()
    engine.global_steps, engine.global_samples = 7, 7 * engine.train_batch_size() // 2  # 7 micro-batches in
    assert torch.equal(resumed(engine, loader()), drawn[7])

    class NoLength(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(dataset[i] for i in range(len(dataset)))

    plain = [x for x, _ in torch.utils.data.DataLoader(NoLength(), batch_size=2)]
    engine = _engine()
    engine.global_steps, engine.global_samples = 2, 4 * 2  # 4 micro-batches in: the 2nd of the 2nd pass
    assert torch.equal(resumed(engine, torch.utils.data.DataLoader(NoLength(), batch_size=2)), plain[1])
    one = StandInEngine(GPT(GPTConfig.preset("tiny")), micro_batch=1, accumulation=1)
    one.global_steps, one.global_samples = 1, 1
    assert torch.equal(resumed(one, loader(1)), [x for x, _ in loader(1)][1])


class _Recording(torch.nn.Module):
    """The tiny GPT, keeping every input batch its forward sees (what a run trained on, in order)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = GPT(GPTConfig.preset("tiny"))
        self.seen: list[torch.Tensor] = []

    def forward(self, x, y):
        self.seen.append(x.clone())
        return self.inner(x, y)


def _resume_world2(save_dir: str) -> dict:
    """On each of 2 ranks (a real engine, ZeRO-1, SGD, no clipping, accumulation 2; each rank its half of the
    samples by a DistributedSampler, which cannot seek): 4 uninterrupted steps; then 2 steps, saved, and a new
    engine resumed from the save for steps 3-4. The inputs each run trained on, and its final weights."""
    import zerotrain

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1},
              "steps_per_print": 0, "comm_timeout_seconds": 60}

    from zerotrain import dist

    def run(total_steps: int, save: bool = False, load: bool = False):
        model = _Recording()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        if load:
            engine.load_checkpoint(save_dir)
        dataset = TokenBlockDataset(load_stdlib_corpus(max_bytes=48 * 16 + 1), 16)  # 48 samples, 12 batches a rank
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)
        trainer = Trainer(engine, loader, total_steps=total_steps, save_dir=save_dir if save else None,
                          console=Console(file=io.StringIO()))
        trainer.train()
        seen, evaluated = list(model.seen), None
        if load:  # the evaluation over every rank's batches: rank 0 evaluates 2 micro-batches, rank 1 one
            batches = [tuple(torch.stack(t) for t in zip(dataset[i], dataset[i + 1]))
                       for i in ((0, 2) if dist.get_rank() == 0 else (4,))]
            trainer.eval_data = batches
            with torch.no_grad():
                engine.eval()
                own = [float(engine(x, y)[1]) for x, y in batches]
                engine.train()
            evaluated = (trainer.evaluate(), own)
        weights = engine.full_state_dict()
        engine.close()
        return seen, weights, evaluated

    whole, whole_weights, _ = run(4)
    first, _, _ = run(2, save=True)
    resumed, resumed_weights, evaluated = run(4, load=True)
    # an elastic restart seen by one node's agents only (the other node's agent restarted its ranks for the new
    # round without raising its count): `zerotrain train` must resume on every rank or on none
    from zerotrain.run import job_restarts
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if dist.get_rank() == 1 else "0"
    return {"whole": whole, "first": first, "resumed": resumed, "whole weights": whole_weights,
            "resumed weights": resumed_weights, "restarts": job_restarts(), "evaluated": evaluated}


def test_trainer_resumed_at_world2_trains_on_the_samples_the_uninterrupted_run_did(tmp_path):
    # each step draws 2 micro-batches of 2 samples on each of 2 ranks: the resumed run (global_samples 16) skips
    # 4 of each rank's batches, not 8 (global_samples / micro, forgetting the data-parallel size)
    from distributed import run_distributed

    results = run_distributed(_resume_world2, 2, str(tmp_path), timeout=240)
    # the evaluation's loss: the mean over every rank's micro-batches (3: rank 0's two and rank 1's one), reduced in
    # the step's one reduction; not the mean of the ranks' means (issue 42)
    losses = [loss for got in results for loss in got["evaluated"][1]]
    assert len(losses) == 3 and abs(sum(losses[:2]) / 2 - losses[2]) > 1e-3, losses
    for rank, got in enumerate(results):
        assert got["evaluated"][0] == pytest.approx(sum(losses) / 3, rel=1e-9), (rank, got["evaluated"], losses)
    for rank, got in enumerate(results):
        assert len(got["whole"]) == 8 and len(got["first"]) == 4 and len(got["resumed"]) == 4, rank
        assert got["restarts"] == 1, rank
        assert len({tuple(x.flatten().tolist()) for x in got["whole"]}) == 8, rank  # 8 different batches
        for index, (x, want) in enumerate(zip(got["first"] + got["resumed"], got["whole"])):
            assert torch.equal(x, want), (rank, index)
        if rank == 0:
            for name, weight in got["whole weights"].items():
                torch.testing.assert_close(got["resumed weights"][name], weight, rtol=1e-5, atol=1e-6)


def test_version_prints_the_package_version(capsys):
    import zerotrain

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"zerotrain {zerotrain.__version__}"


def test_launch_bad_input_exits_2_naming_it(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for argv, message in ((["launch", str(tmp_path / "nope.py")], "nope.py' not found"),
                          (["launch", "--nproc", "0", str(script)], "--nproc must be >= 1"),
                          (["launch", "--nnodes", "2", str(script)], "--nnodes > 1 needs --master-addr"),
                          (["launch", "--nnodes", "2", "--node-rank", "2", str(script)], "--node-rank must be in")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_launch_passes_local_rank_only_to_scripts_that_declare_it(tmp_path):
    from zerotrain.launcher import worker_target

    declares = tmp_path / "a.py"
    declares.write_text("p.add_argument('--local_rank', type=int)\n")
    dashed = tmp_path / "b.py"
    dashed.write_text('p.add_argument("--local-rank", type=int)\n')
    silent = tmp_path / "c.py"
    silent.write_text("import os\nrank = int(os.environ['LOCAL_RANK'])  # --local_rank in a comment only\n")
    assert worker_target(str(declares), ["--x"]) == ["-m", "zerotrain.launcher", "--pass-local-rank", "--",
                                                     str(declares), "--x"]
    assert "--pass-local-rank" in worker_target(str(dashed), [])
    assert "--pass-local-rank" not in worker_target(str(silent), [])
    assert "--pass-local-rank" not in worker_target(str(declares), [], pass_local_rank=False)
    assert "--pass-local-rank" not in worker_target(str(declares), ["--local_rank=3"])


def test_launch_rendezvous_and_worker_arguments(tmp_path, monkeypatch):
    """The torchrun options `launch` builds (standalone on one node without an address; a static rendezvous
    otherwise), and the worker's reading of its arguments with or without the separator (torchrun's parser
    drops it when no worker flag precedes it)."""
    from zerotrain.command import rendezvous
    from zerotrain.launcher import run_worker

    assert rendezvous(2) == ["--standalone", "--nproc_per_node", "2"]
    assert rendezvous(8, 2, 1, "node0", 29400) == ["--nnodes", "2", "--node_rank", "1", "--master_addr", "node0",
                                                    "--master_port", "29400", "--nproc_per_node", "8"]
    assert rendezvous(2, master_port=1234)[:8] == ["--nnodes", "1", "--node_rank", "0", "--master_addr",
                                                    "127.0.0.1", "--master_port", "1234"]
    script = tmp_path / "echo.py"
    out = tmp_path / "argv.json"
    script.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    for argv, expected in ((["--", str(script), "--nproc", "3"], ["--nproc", "3"]),
                           ([str(script), "--nproc", "3"], ["--nproc", "3"]),
                           (["--pass-local-rank", "--", str(script), "x"], ["x", "--local_rank=1"])):
        run_worker(argv)
        assert json.loads(out.read_text()) == expected, argv
    with pytest.raises(SystemExit, match="unknown worker flag"):
        run_worker(["--frobnicate", "--", str(script)])


BAD_KEY_SCRIPT = """
import torch, zerotrain
zerotrain.init_distributed()
zerotrain.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 2, "zero_optimization": {"stag": 2}})
"""


def test_launch_reports_a_usage_error_in_the_script_as_one_line_once(tmp_path, monkeypatch, capsys):
    """A config error raised in the user's script (a bad key) under `zerotrain launch --nproc 2`: one line naming
    the key, printed once, exit status 2, no rank traceback (as `zerotrain train`). Any other exception in the
    script keeps its traceback (in-process: the worker re-raises it)."""
    from distributed import run_cli, served_python
    from zerotrain.launcher import run_worker

    script = tmp_path / "bad_key.py"
    script.write_text(BAD_KEY_SCRIPT)
    # the launcher, its agent and ranks forked from the test forkserver (served_python as torch's PYTHON_EXEC)
    proc = run_cli(["launch", "--nproc", "2", str(script)], cwd=tmp_path,
                   env=dict(os.environ, PYTHON_EXEC=served_python()))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "zero_optimization.stag" in line]
    assert said == ["zerotrain: error: unknown key 'zero_optimization.stag'; did you mean 'stage'?"], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr

    other = tmp_path / "other.py"
    other.write_text("raise KeyError('not a usage error')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(KeyError, match="not a usage error"):
        run_worker([str(other)])


def _calls(node) -> list[str]:
    """Dotted names of the calls in `node` (`dist.barrier`, `engine.close`, ...), in source order."""
    import ast

    names = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            names.append(ast.unparse(call.func))
    return names


def test_every_command_ends_on_a_barrier_before_tearing_down():
    """The audit of issue #30 bug 2, kept: every function in zerotrain/ that tears torch.distributed down in a
    `finally` (the commands' ranks: train, train-embedding, generate; merge, ckpt, estimate and plot start no
    process group) ends its `try` body with `dist.barrier()` (torch's barrier on gloo). An all-reduce or
    all-gather as the last collective leaves a work holding a Python-made tensor that gloo's thread may
    release while the interpreter finalizes: SIGABRT 'terminate called without an active exception' at
    exit, in some runs only (`generate --nproc 2` ended on its all-gather of the texts)."""
    import ast

    found = []
    for path in sorted((REPO / "zerotrain").rglob("*.py")):
        if path.name == "dist.py":
            continue  # the wrappers themselves
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Try) and node.finalbody
                    and any(name.endswith("destroy_process_group") for name in _calls(ast.Module(node.finalbody, [])))):
                continue
            last = node.body[-1]
            if isinstance(last, ast.If) and len(last.body) == 1:  # `if dist.is_initialized(): dist.barrier()`
                last = last.body[0]
            where = f"{path.relative_to(REPO)}:{last.lineno}"
            found.append(where)
            assert isinstance(last, ast.Expr) and _calls(last) == ["dist.barrier"], \
                f"{where}: the last statement before the teardown is {ast.unparse(last)!r}, not dist.barrier()"
    assert len(found) >= 3, found  # train, train-embedding, generate


def test_start_notes_say_lora_share_and_where_metrics_go(capsys):
    """Rank 0's notes after the start line: a LoRA run's trainable parameters as peft prints them, and, without
    --log-dir, that metrics are not written to files (both used to be silent)."""
    import peft
    import transformers

    from zerotrain.cli import build_parser
    from zerotrain.run.lm import start_notes
    from zerotrain.run.model import lora_options

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.print_trainable_parameters()
    peft_line = capsys.readouterr().out.strip()
    args = build_parser().parse_args(["train", "--config", "c.json", "--lora-r", "4"])
    lora, plain = start_notes(args, model, lora_options(args))
    assert lora == f"zerotrain: LoRA: {peft_line}" and "trainable%" in lora
    assert plain.startswith("zerotrain: metrics go to this output only; --log-dir DIR")
    args = build_parser().parse_args(["train", "--config", "c.json", "--log-dir", "runs"])
    assert start_notes(args, model, None) == []


def test_a_rank_start_up_error_is_one_line_once_at_nproc_2(tiny_llama_dir, tmp_path):
    """An error the ranks meet at start-up (here: the text field is not in the .jsonl.gz records) is printed
    once, one line, exit status 2, as at --nproc 1: the rank hands it to the launcher through its torchelastic
    error file; no rank traceback, no launcher ChildFailedError table (there were 40-70 lines of both). The
    message names the record's keys and --text-field, and the compressed file was read to find them."""
    import gzip

    data = tmp_path / "notes.jsonl.gz"
    data.write_bytes(gzip.compress(b'{"text": "def f(): pass"}\n{"text": "x = 1"}\n'))
    from distributed import run_cli, served_python

    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROTRAIN_DATA_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHON_EXEC=served_python())  # the agent and ranks forked from the test forkserver too
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    proc = run_cli(["train", "--config", str(REPO / "examples/zero2.json"), "--nproc", "2", "--model",
                    str(tiny_llama_dir), "--data", str(data), "--text-field", "body", "--steps", "1", "--no-save"],
                   env=env, timeout=300, cwd=tmp_path)  # the launcher forked from the test forkserver
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # a library's own log warnings are not errors, even when they mention the word (torch's "[rank0]:W1205 ...
    # will be an error in a future release", logged when transformers imports an installed torchao)
    warning = re.compile(r"^(\[rank\d+\]:)?W\d{4} ")
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and not warning.match(line)]
    assert errors == [f"zerotrain: error: {data}, line 1: missing field 'body' (or chat 'messages'); the record's "
                      "keys are 'text': name the text field with --text-field (DataConfig.text_field) (and 1 more "
                      "bad records; skip_bad_records skips them)"], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr


def test_resume_from_a_named_checkpoint_names_intact_ones_and_warns_of_another_max_steps(tmp_path, monkeypatch,
                                                                                          capsys):
    """Issue 47: --resume-from-checkpoint TAG|PATH (TrainingArguments' name) continues exactly from that checkpoint;
    a damaged latest is refused naming the newest intact tags and the flag; a resume whose --max-steps lays the
    schedule over other steps says so once, in one line, naming both."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)

    def gloo_threads() -> int:
        count = 0
        for task in os.listdir("/proc/self/task"):
            try:
                count += open(f"/proc/self/task/{task}/comm").read().startswith("pt_gloo")
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        return count

    def train(*argv: str) -> tuple[int, str, str]:
        before = gloo_threads()
        status = main(["train", "--model", "tiny", "--max-corpus-bytes", "20000", "--eval-batches", "1",
                       "--output-dir", "ck", *argv])
        out, err = capsys.readouterr()
        # the run's process group is gone with its gloo threads when the command returns, not at the process's
        # exit, where a worker dropping a finished collective's tensors aborts the rank (`cli.main`'s collection)
        assert gloo_threads() <= before, f"gloo worker threads left by train {argv}"
        return status, out, err

    def losses(log: str) -> dict:
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / log / "metrics.jsonl").read_text().splitlines())}

    assert train("--max-steps", "3", "--save-every", "1", "--log-dir", "a")[0] == 0
    whole = losses("a")
    (tmp_path / "ck" / "global_step3" / "optimizer-00001-of-00001.safetensors").unlink()  # latest, damaged
    status, out, err = train("--max-steps", "4", "--resume")
    assert status == 1 and err.count("error:") == 1, err
    assert "optimizer-00001-of-00001.safetensors" in err and "the newest intact checkpoints in " in err
    assert err.rstrip().endswith(": global_step2 (step 2), global_step1 (step 1); resume from one with "
                                 "--resume-from-checkpoint global_step2"), err
    # the tag it names, with the same --max-steps: step 3 again, exactly as the uninterrupted run (no warning)
    status, out, err = train("--max-steps", "3", "--resume_from_checkpoint", "global_step2", "--log-dir", "b")
    assert status == 0 and f"resumed from {tmp_path / 'ck' / 'global_step2'} at step 2" in out, out + err
    assert "warning" not in err and losses("b") == {3: whole[3]}
    # a checkpoint directory, with another --max-steps: warned once, one line, the old and new step counts
    status, out, err = train("--max-steps", "5", "--resume-from-checkpoint", str(tmp_path / "ck" / "global_step2"))
    assert status == 0, err
    warned = [line for line in (out + err).splitlines() if "learning-rate schedule" in line]
    assert warned == [f"zerotrain: warning: resuming {tmp_path / 'ck' / 'global_step2'}, saved with a learning-rate "
                      "schedule over 3 steps (--max-steps 3), with --max-steps 5: the schedule is now laid out over 5 "
                      "steps, so the learning rate changes at once; give --max-steps 3 to continue the saved "
                      "schedule"], out + err
    assert train("--max-steps", "5", "--resume-from-checkpoint", "global_step9")[2].count(
        "--resume-from-checkpoint global_step9: not a checkpoint directory nor a tag in") == 1


def test_a_directory_named_like_a_preset_without_config_json_does_not_hide_it(tmp_path, monkeypatch, capsys):
    """Issue 47: `--model tiny` where ./tiny is a run directory (no config.json): the preset, said once in one line;
    a directory with config.json is still the model."""
    from zerotrain.cli import build_parser
    from zerotrain.models.hf import resolve_model
    from zerotrain.train.command import check_train_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    check_train_args(build_parser().parse_args(["train", "--model", "tiny"]))
    err = capsys.readouterr().err
    assert err == ("zerotrain: --model tiny: ./tiny is a directory without config.json, not a model; using the "
                   "built-in preset 'tiny' (give ./tiny a config.json, or another name, to train a directory)\n")
    assert resolve_model("tiny").preset == "tiny"
    (tmp_path / "tiny" / "config.json").write_text("{}")
    with pytest.raises(Exception, match="tiny"):  # now the directory is meant: its own errors
        resolve_model("tiny")
