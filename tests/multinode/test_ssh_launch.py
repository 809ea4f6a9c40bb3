"""`zerotrain launch --hostfile` over ssh across two network-namespace hosts (issue #46): an sshd per node (keys
made for this run, torn down with the nodes), the launcher on node0 starts one `zerotrain launch` per host
through ssh (DeepSpeed's pdsh launcher's job).

- A DeepSpeed-style script (`--deepspeed_config`), one rank a host, trains as one process does; the launcher
  killed mid-run ends every rank on both hosts, each saving at a step boundary although its output channel is
  gone (the config prints progress every 2 steps: each host's launch relays its ranks' output, `relay_output`).
- The issue's "Done when" job file as it is, its first word changed: `zerotrain launch --hostfile hostfile
  train.py --deepspeed ds.json ...` with an HF-Trainer script (transformers' `HfArgumentParser`,
  `TrainingArguments`, `--deepspeed ds.json`, as upstream example scripts; its Trainer imports from
  zerotrain.hf), 2 hosts x 2 ranks, ZeRO-3, a tiny HF Llama: every step's loss, gradient norm and learning rate
  and the saved weights equal single-process AdamW (the Trainer's linear schedule, clipping 1.0 as ds.json
  says) within 1e-5. Then node1's ranks SIGKILLed mid-run (found by pid in node1's namespace) end the job on
  both hosts within the config's comm timeout, nothing left on either host, and the launcher exits non-zero
  with one line naming node1 (`zerotrain.hostfile.run_hosts`).

A real start on each host, so `slow`; the default suite has the unreachable-host error, one host's failure
stopping the others with its line, and the closed channel with printing ranks (tests/test_hostfile.py)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

import llama_job
from distributed import free_port
import netns
from sshd import sshd_missing, make_keys, ssh_options, python_left, start_sshd, wait_for_ssh
from test_dropin_api import (DEEPSPEED_SCRIPT, DEEPSPEED_SCRIPT_CONFIG, REPO_ROOT, STOPPABLE_SCRIPT,
                             _assert_trained_as_one_process)
from test_openmpi_launch import JOB, assert_killing_node1s_ranks_ends_the_job

_reason = netns.skip_reason() or sshd_missing()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]


@contextlib.contextmanager
def _ssh_hosts(tmp_path, hostfile: str):
    """Two namespace hosts with an sshd each (keys made for the run) and `hostfile` written: yields (nodes,
    launch, env), `launch` the `zerotrain launch --hostfile hostfile` prefix over ssh (its port and key); the sshds
    are stopped and the hosts torn down always."""
    make_keys(tmp_path)
    port = free_port()
    (tmp_path / "hostfile").write_text(hostfile)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "zerotrain.cli", "launch", "--hostfile", "hostfile", "--ssh_port", str(port),
              f"--launcher_args={ssh_options(tmp_path)}", "--master_port", str(free_port())]
    with netns.two_nodes() as nodes:
        daemons = [start_sshd(node, tmp_path, port) for node in nodes.nodes]
        try:
            wait_for_ssh(nodes, tmp_path, port)
            yield nodes, launch, env
        finally:
            for daemon in daemons:
                daemon.kill()
                daemon.wait()


@pytest.mark.timeout(900)  # ~70 s on a quiet machine, 220-300+ s at load 18-27 (pytest's default 300 s cut it)
def test_hostfile_launch_over_ssh_trains_across_two_hosts_and_stops_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the nodes' commands run in the current directory (netns.Node.command)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DEEPSPEED_SCRIPT_CONFIG))
    (tmp_path / "train.py").write_text(DEEPSPEED_SCRIPT)
    (tmp_path / "stoppable.py").write_text(STOPPABLE_SCRIPT)
    (tmp_path / ".deepspeed_env").write_text("ZT_FROM_DEEPSPEED_ENV=forwarded\n")
    with _ssh_hosts(tmp_path, "# two hosts, one rank each\nnode0 slots=1\nnode1 slots=1\n") as (nodes, launch, env):
        out = tmp_path / "out"
        out.mkdir()
        proc = subprocess.run(nodes[0].command([*launch, "train.py", "--deepspeed_config", str(config),
                                                "--out", str(out)]),
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for rank in (0, 1):
            info = json.loads((out / f"rank{rank}.json").read_text())
            assert (info["world"], info["env_local_rank"], info["visible"], info["steps"]) == (2, 0, "0", 4)
        _assert_trained_as_one_process(out)

        # the launcher killed (SIGKILL: no handler runs) mid-run: its ssh clients die with it, each host's
        # launch sees its channel close and stops its ranks: nothing is left on either host
        stop_out = tmp_path / "stop"
        stop_out.mkdir()
        launcher = subprocess.Popen(nodes[0].command([*launch, "stoppable.py", "--out", str(stop_out),
                                                      "--nproc", "2", "--deepspeed_config", str(config)]),
                                    cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        deadline = time.monotonic() + 300
        while not (stop_out / "running").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
            time.sleep(0.2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 120
        while python_left(nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert python_left(nodes) == [], launcher.stdout.read()
        # stopped, not killed: every rank on both hosts got the stop, saved at a step boundary and ended
        assert sorted(p.name for p in stop_out.glob("stopped*.json")) == ["stopped0.json", "stopped1.json"]


HF_SCRIPT = '''"""A Hugging Face Trainer script as transformers' example scripts are written: its arguments parsed by
HfArgumentParser into TrainingArguments (`--deepspeed ds.json` among them); the Trainer's two imports from
zerotrain.hf (docs/hf.md), nothing else changed."""
import json
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

from zerotrain.hf import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a pretrained model's directory"})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "a JSON list of token-id rows"})


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    with open(data_args.train_file) as f:
        rows = [torch.tensor(row) for row in json.load(f)]
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=[{"input_ids": row, "labels": row} for row in rows])
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
'''

# A DeepSpeed config as HF users write it: the batch sizes "auto" (the Trainer's arguments), clipping 1.0
HF_DS_CONFIG = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0, "steps_per_print": 2000,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                      "stage3_gather_16bit_weights_on_model_save": True}}
HF_LR = 1e-2


def _hf_reference(model_dir) -> tuple[list, dict]:
    """Plain single-process PyTorch on the job's global batches (llama_job.batches(): the Trainer's sequential
    sampler gives step k rows 8k..8k+7 over the 4 ranks): torch AdamW (the Trainer's: weight decay 0), its
    linear schedule (transformers' `get_scheduler`), clipping 1.0. Every step's (step, loss, lr, grad norm) and
    the final weights."""
    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, weight_decay=0.0)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=llama_job.STEPS)
    log = []
    for step, ids in enumerate(llama_job.batches(), start=1):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        log.append((step, loss.item(), lr, norm.item()))
    return log, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(1500)  # a 4-rank HF Trainer run and a killed 4-rank run over ssh: minutes at load 20+
def test_deepspeed_job_file_with_an_hf_trainer_script_runs_over_ssh_and_one_hosts_ranks_killed_end_the_job(
        tmp_path, monkeypatch):
    """`deepspeed --hostfile hostfile train.py --deepspeed ds.json ...` with `zerotrain launch` as its first words:
    2 hosts x 2 ranks, ZeRO-3, equal to one process; then node1's ranks killed end the job everywhere, in time,
    named in one line."""
    import torch
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    llama_job.make_model(initializer_range=0.1).save_pretrained(tmp_path / "model")  # norms > 1: clipping acts
    (tmp_path / "train.json").write_text(json.dumps(torch.cat(llama_job.batches()).tolist()))
    (tmp_path / "train.py").write_text(HF_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(HF_DS_CONFIG))
    job = ["train.py", "--deepspeed", "ds.json", "--model_name_or_path", "model", "--train_file", "train.json",
           "--output_dir", "out", "--per_device_train_batch_size", "2", "--max_steps", str(llama_job.STEPS),
           "--learning_rate", str(HF_LR), "--train_sampling_strategy", "sequential", "--logging_steps", "1",
           "--save_strategy", "no", "--report_to", "none", "--use_cpu"]  # on CPU: else accelerate sees 1 process
    with _ssh_hosts(tmp_path, "node0 slots=2\nnode1 slots=2\n") as (nodes, launch, env):
        proc = subprocess.run(nodes[0].command([*launch, *job]), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
        state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
        log = [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in state["log_history"] if "loss" in h]
        reference_log, reference = _hf_reference(tmp_path / "model")
        assert [step for step, *_ in log] == list(range(1, llama_job.STEPS + 1)), log
        for (_, loss, lr, norm), (_, ref_loss, ref_lr, ref_norm) in zip(log, reference_log):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), \
                (log, reference_log)
            assert lr == pytest.approx(ref_lr, rel=1e-12), (log, reference_log)
        assert min(norm for *_, norm in reference_log) > 1.0  # clipping acted on every step
        weights = load_file(tmp_path / "out" / "model.safetensors")
        initial = llama_job.make_model(initializer_range=0.1).state_dict()
        assert set(weights) == set(reference), sorted(set(weights) ^ set(reference))
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
            assert not torch.equal(weights[name], initial[name]), name

        # node1's two ranks SIGKILLed mid-run (found by pid in node1's namespace): node1's launch fails, the
        # launcher closes node0's channel and node0's ranks stop (their collectives fail too): every rank on
        # both hosts ends within the comm timeout, nothing is left, and one line names the host that failed
        said = assert_killing_node1s_ranks_ends_the_job(nodes, [*launch, JOB], tmp_path, env)
        named = [line for line in said.splitlines() if line.startswith("zerotrain: error: host ")]
        assert named == ["zerotrain: error: host 'node1' (node rank 1, ranks 2-3 of 4) failed: exit status 1; the "
                         "job was stopped on every other host"], said[-6000:]
