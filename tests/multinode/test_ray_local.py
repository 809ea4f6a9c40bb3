"""Ray Train's fast case in the default suite (issue #46: "one fast case per launcher"): a one-host Ray started by
the test (`ray.init`, 2 CPUs, no dashboard), Ray Train's `TorchTrainer` with 2 workers runs the cluster tests'
ZeRO-3 tiny-Llama job (tests/multinode/llama_job.py) inside the process group Ray made, and the saved weights
equal single-process AdamW within 1e-5. The two-host run (`test_ray.py`, slow) adds the namespaces and Ray's
worker node. Ray's own start is most of this test's ~15-20 s (measured in test_ray.py's docstring)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import llama_job
from test_dropin_api import REPO_ROOT

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'zerotrain[ray]')")
ray_torch = pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'zerotrain[ray]')")


def _train_loop_per_worker(config: dict) -> None:
    import ray.train

    import llama_job as job  # imported in the worker, from the PYTHONPATH Ray's processes inherit

    info = job.train(config["out"])
    ray.train.report({"loss": info["losses"][-1]})


def test_ray_torchtrainer_on_one_host_trains_the_zerotrain_job_as_one_process(tmp_path, monkeypatch):
    from ray.train import RunConfig, ScalingConfig

    out = tmp_path / "out"
    out.mkdir()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # Ray's raylet and workers inherit the driver's environment: the job's modules and one thread per worker.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO_ROOT, tests_dir, os.path.dirname(tests_dir)]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Train's controller polls its workers every 2 s (a poll that is late is waited on, a worker is only
    # declared dead after 10 minutes without an answer): it sees the training end within 0.2 s instead
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    ray_dir = tempfile.mkdtemp(prefix="ztray")  # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir,
                 object_store_memory=80_000_000)
        trainer = ray_torch.TorchTrainer(
            _train_loop_per_worker, train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=str(tmp_path / "storage"), name="zerotrain"))
        trainer.fit()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    llama_job.assert_trained_as_one_process(str(out), world=2, hosts=1)
