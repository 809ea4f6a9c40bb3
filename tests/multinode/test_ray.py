"""Ray Train across two network-namespace hosts (issue #46): `ray start --head` on node0, a worker node on node1,
and a driver on node0 runs Ray Train's `TorchTrainer` with 4 workers spread over both hosts. Ray sets up the
process group (gloo, its own rendezvous) and the workers' RANK / WORLD_SIZE / LOCAL_RANK; the training function
is the ZeRO-3 tiny-Llama job (tests/multinode/llama_job.py), whose `zerotrain.initialize` takes the process
group Ray made, and equals single-process AdamW within 1e-5. The checkpoint goes to zerotrain's own directory
on storage every host sees (the RunConfig's storage path), not through Ray's `Checkpoint`: see
docs/multinode.md. Ray's own start takes ~20 s here and the run ~1.5 min, so `slow`. No default-suite case, measured
(round 4 of #46): a one-host `TorchTrainer` in the test process (`ray.init(num_cpus=2, include_dashboard=False,
log_to_driver=False, _temp_dir=<short>, object_store_memory=80 MB)`, no runtime_env, 2 workers, the
73-parameter OddMLP at ZeRO-3, 3 steps: losses equal to `reference_training`'s within 1e-7) costs ~30
CPU-seconds whatever the load: the two workers 9.8 (torch, zerotrain and `initialize`), the driver 7.0 (`import
ray`'s 2.8 of it), Ray Train's controller 3.7,
its placement-group cleaner 2.3, Ray Data's autoscaling coordinator 1.8 and dataset manager 1.7 (started with no
dataset), raylet 1.2, GCS 1.1, the dashboard agent 0.8 (running with the dashboard off), the runtime-env agent 0.6.
On the 2-core machine that is >= 15 s wall with nothing else running and 77-394 s at load 17-38 (import 10-28 s,
`ray.init` 15-61 s, the fit 50-300 s; Ray Train v1, `RAY_TRAIN_V2_ENABLED=0`, was no faster: 219 s), against the
~25 s a default case may take. The training itself is 0.03 s of it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import llama_job
import netns
from distributed import free_port
from test_dropin_api import REPO_ROOT

RAY = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
_reason = netns.skip_reason() or (None if os.path.exists(RAY) else "Ray is not installed (pip install 'zerotrain[ray]')")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

DRIVER = '''
import os, sys
import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

address, out, storage = sys.argv[1:4]


def train_loop_per_worker(config):
    import llama_job  # the zerotrain job: zerotrain.initialize inside Ray's process group
    info = llama_job.train(config["out"], save_dir=config["save_dir"])
    ray.train.report({"loss": info["losses"][-1], "checkpoint_dir": config["save_dir"]})


ray.init(address=address, runtime_env={"env_vars": {k: os.environ[k] for k in
                                                     ("PYTHONPATH", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}})
trainer = TorchTrainer(train_loop_per_worker,
                       train_loop_config={"out": out, "save_dir": os.path.join(storage, "zerotrain-ckpt")},
                       scaling_config=ScalingConfig(num_workers=4, use_gpu=False, resources_per_worker={"CPU": 1},
                                                    placement_strategy="SPREAD"),
                       run_config=RunConfig(storage_path=storage, name="zerotrain"))
result = trainer.fit()
print("RESULT", result.metrics)
'''

# The same trainer on a run that does not end by itself; Ray Train's default failure handling
# (FailureConfig(max_failures=0): no retry), which fit() reports by raising
LONG_DRIVER = '''
import json, os, sys
import ray
import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

address, out, storage = sys.argv[1:4]


def train_loop_per_worker(config):
    import llama_job
    llama_job.train(config["out"], steps=100000, sleep=0.05)


ray.init(address=address, runtime_env={"env_vars": {k: os.environ[k] for k in
                                                     ("PYTHONPATH", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}})
trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"out": out},
                       scaling_config=ScalingConfig(num_workers=4, use_gpu=False, resources_per_worker={"CPU": 1},
                                                    placement_strategy="SPREAD"),
                       run_config=RunConfig(storage_path=storage, name="zerotrain-killed",
                                            failure_config=FailureConfig(max_failures=0)))
try:
    trainer.fit()
except ray.train.TrainingFailedError as error:
    failures = getattr(error, "worker_failures", {})
    # rank -> its failure's type, and the type of what Ray found when the worker stopped answering (a dead
    # worker is a WorkerHealthCheckFailedError whose health_check_failure is Ray's actor error)
    print("FAILED", type(error).__name__, json.dumps({
        rank: "/".join([type(e).__name__, *([type(e.health_check_failure).__name__]
                                            if hasattr(e, "health_check_failure") else [])])
        for rank, e in failures.items()}), flush=True)
    print(error, flush=True)
    sys.exit(3)
print("FINISHED")
'''


def train_worker_pids(node) -> list[int]:
    """Ray Train's worker processes in `node` (the actors that run the training function: Ray titles them
    `ray::RayTrainWorker...`)."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split():
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if cmdline.startswith(b"ray::RayTrainWorker"):
            found.append(int(pid))
    return found


@pytest.mark.timeout(1500)  # Ray's start on two hosts, a 4-worker run and a killed one: minutes at load 20+
def test_ray_torchtrainer_runs_a_zerotrain_job_across_two_hosts_and_one_hosts_workers_killed_end_it(tmp_path):
    """The job trains as one process; then, in a run that would not end, node1's Ray Train workers (the training
    function's processes) SIGKILLed: fit() raises Ray Train's `WorkerGroupError` (FailureConfig(max_failures=0),
    Ray's default: no retry) naming the dead workers' ranks, within the job's comm timeout, and Ray ends the
    workers on node0 (its worker group shut down): no training worker is left on either host."""
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "long_driver.py").write_text(LONG_DRIVER)
    out, storage = tmp_path / "out", tmp_path / "storage"
    out.mkdir()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC"))}
    # RAY_AUTH_MODE: Ray (2.5x+) turns token auth on for `ray start --head` when ~/.ray/auth_token exists (any
    # earlier `ray.init()` on this machine writes one, e.g. test_ray_local.py), and the worker node's start is then
    # refused ("Authentication token is missing or incorrect"); this cluster lives in the test's namespaces
    env.update(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{tests_dir}", GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               RAY_raylet_start_wait_time_s="180")  # a node's registration: Ray's 30 s ran out at load 30
    port = free_port()
    ray_dir = tempfile.mkdtemp(prefix="ztray")  # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes
    with netns.two_nodes(shm_size="512m") as nodes:  # Ray's object store lives in each node's /dev/shm
        address = f"{nodes[0].address}:{port}"
        try:
            head = subprocess.run(nodes[0].command([RAY, "start", "--head", "--node-ip-address", nodes[0].address,
                                                    "--port", str(port), "--num-cpus", "2", "--object-store-memory",
                                                    "100000000", "--include-dashboard=false",
                                                    "--temp-dir", ray_dir]),
                                  env=env, capture_output=True, text=True, timeout=240)
            assert head.returncode == 0, head.stdout + head.stderr
            worker = subprocess.run(nodes[1].command([RAY, "start", "--address", address, "--node-ip-address",
                                                      nodes[1].address, "--num-cpus", "2", "--object-store-memory",
                                                      "100000000", "--temp-dir", ray_dir]),
                                    env=env, capture_output=True, text=True, timeout=240)
            assert worker.returncode == 0, worker.stdout + worker.stderr
            driver = subprocess.run(nodes[0].command([sys.executable, str(tmp_path / "driver.py"), address, str(out),
                                                      str(storage)]),
                                    env=env, capture_output=True, text=True, timeout=600)
            assert driver.returncode == 0, driver.stdout[-4000:] + driver.stderr[-4000:]
            _assert_killing_node1s_workers_ends_the_run(nodes, tmp_path, address, storage, env)
        finally:
            for node in reversed(nodes.nodes):
                subprocess.run(node.command([RAY, "stop", "--force"]), env=env, capture_output=True, timeout=120)
            shutil.rmtree(ray_dir, ignore_errors=True)
    llama_job.assert_trained_as_one_process(str(out), world=4, hosts=2)
    checkpoint = storage / "zerotrain-ckpt"
    assert (checkpoint / "latest").read_text().strip() == f"global_step{llama_job.STEPS}", os.listdir(checkpoint)


def _assert_killing_node1s_workers_ends_the_run(nodes, tmp_path, address: str, storage, env: dict) -> None:
    """The long driver on node0; once the job runs, SIGKILL node1's training workers: the driver fails with
    Ray Train's error naming them within the comm timeout, and no training worker is left on either host."""
    long_out = tmp_path / "long"
    long_out.mkdir()
    log = tmp_path / "long_driver.log"  # a file, not a pipe: Ray's driver prints its workers' logs as it goes
    with open(log, "w") as output:
        driver = subprocess.Popen(nodes[0].command([sys.executable, str(tmp_path / "long_driver.py"), address,
                                                    str(long_out), str(storage)]),
                                  env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    said = lambda: log.read_text()[-6000:]  # noqa: E731
    try:
        deadline = time.monotonic() + 900  # Ray's four workers took 8 min to start at load 70
        while not (long_out / "running").exists():
            assert driver.poll() is None and time.monotonic() < deadline, said()
            time.sleep(0.2)
        victims, others = train_worker_pids(nodes[1]), train_worker_pids(nodes[0])
        assert len(victims) == 2 and len(others) == 2, (victims, others)  # SPREAD: two workers a host
        ranks = {json.loads(p.read_text())["rank"] for p in long_out.glob("pid*.json")
                 if json.loads(p.read_text())["pid"] in victims}
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        try:
            status = driver.wait(timeout=llama_job.CONFIG["comm_timeout_seconds"] + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run outlived node1's workers: {said()}") from None
        ended = time.monotonic() - killed_at
        assert status == 3, said()
        failed = [line for line in log.read_text().splitlines() if line.startswith("FAILED ")]
        assert len(failed) == 1 and failed[0].startswith("FAILED WorkerGroupError "), (failed, said())
        failures = json.loads(failed[0].split(" ", 2)[2])  # rank -> the type of its failure
        assert len(ranks) == 2 and all(failures.get(str(r), "").startswith("WorkerHealthCheckFailedError/")
                                       and failures[str(r)].endswith(("ActorDiedError", "RayActorError"))
                                       for r in ranks), (ranks, failed)
        assert ended < llama_job.CONFIG["comm_timeout_seconds"], (ended, said())
        deadline = time.monotonic() + 30
        while (train_worker_pids(nodes[0]) or train_worker_pids(nodes[1])) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert train_worker_pids(nodes[0]) == train_worker_pids(nodes[1]) == [], said()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
