"""Shared pytest setup: make `tests/` importable so test modules share helpers; fail the test that leaves
process-global state behind (`_process_state_guard`); keep the collected modules' objects out of the garbage
collector's walks (`pytest_collectreport`)."""
import gc
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest

# DeepSpeed's CPU ops (its shared-memory all-reduce, built when its comm starts in a rank) are JIT builds in torch's
# extensions directory, kept there by op name while their build flags name this environment's paths: a checkout's
# venv and a fresh clone's rebuilt the same directory in turn, ~30 s each time the other had run. One directory per
# Python environment keeps each one's build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.path.expanduser("~"), ".cache", "torch_extensions", "env-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]))

# The environment variables that decide how a process finds its rank and world (torchrun's, the cluster
# launchers' that `zerotrain.cluster` maps onto them, zerotrain's own, the visible devices): a test that sets one
# in the pytest process and keeps it changes what every later in-process run discovers. (DS_ACCELERATOR is not
# one: test_schedules sets it to "cpu" for the process on purpose, before DeepSpeed caches its accelerator.)
GUARDED_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                         "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"})
GUARDED_ENV_PREFIXES = ("TORCHELASTIC_", "ZEROTRAIN_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "SLURM_")


def pytest_collectreport(report) -> None:
    """The objects the collection made (every test module's imports: torch, transformers, DeepSpeed, TRL, Ray, ...,
    some 600,000) are the session's: `gc.freeze` takes them out of the generations the collector walks, so each full
    collection (Python's own as objects pile up, the HF Trainer's `free_memory`, DeepSpeed's ZeRO-3 set-up, a test's
    `gc.collect()`) walks what the tests made since, not them again (0.3 s each in the whole suite's process).
    Objects the tests make are collected as before; the ranks a test starts freeze what they inherit
    (tests/distributed.py)."""
    gc.freeze()


def process_state() -> dict:
    """What a test must give back: torch.distributed up or not, the guarded environment variables, the working
    directory, torch's default dtype and grad mode. Reads torch only where something imported it already (a test
    that imports torch for the first time finds torch's defaults), so a test that never imports torch pays ~10 us."""
    torch = sys.modules.get("torch")
    distributed = sys.modules.get("torch.distributed")
    return {
        "torch.distributed initialized": bool(distributed is not None and distributed.is_available()
                                              and distributed.is_initialized()),
        "environment": {name: value for name, value in os.environ.items()
                        if name in GUARDED_ENV or name.startswith(GUARDED_ENV_PREFIXES)},
        "working directory": os.getcwd(),
        "torch default dtype": str(torch.get_default_dtype()) if torch is not None else "torch.float32",
        "torch grad mode": bool(torch.is_grad_enabled()) if torch is not None else True,
    }


def state_leaks(before: dict, after: dict) -> list:
    """The differences between two `process_state()`s, each as a short phrase; restoring is `restore`'s."""
    leaks = []
    for key in before:
        if key == "environment" or before[key] == after[key]:
            continue
        if key == "torch.distributed initialized" and after[key]:
            leaks.append("torch.distributed initialized (destroy the process group it started)")
        else:
            leaks.append(f"{key} {before[key]!r} -> {after[key]!r}")
    env_before, env_after = before["environment"], after["environment"]
    for name in sorted(set(env_before) | set(env_after)):
        if env_before.get(name) != env_after.get(name):
            leaks.append(f"${name} {env_before.get(name)!r} -> {env_after.get(name)!r}")
    return leaks


def restore(before: dict, after: dict) -> None:
    """Put back what a leaking test changed, so that only that test fails and not the ones after it."""
    if after["torch.distributed initialized"] and not before["torch.distributed initialized"]:
        import torch.distributed

        torch.distributed.destroy_process_group()
    for name in set(before["environment"]) | set(after["environment"]):
        if name in before["environment"]:
            os.environ[name] = before["environment"][name]
        else:
            os.environ.pop(name, None)
    os.chdir(before["working directory"])
    if "torch" in sys.modules:
        import torch

        torch.set_default_dtype(getattr(torch, before["torch default dtype"].split(".")[-1]))
        torch.set_grad_enabled(before["torch grad mode"])


@pytest.fixture
def world_of_one():
    """For a test that builds an engine in the pytest process: the world of one the engine starts is torn down
    after the test (before the guard below looks)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _process_state_guard(request):
    """Fail the test that leaves torch.distributed initialized, a launcher variable set or changed, another
    working directory, default dtype or grad mode: one line naming the test and what it left. Autouse and set up
    first, so it is torn down last, after `monkeypatch` and the test's own fixtures gave back what they hold (a
    state held by a module- or session-scoped fixture started before the test is not the test's leak)."""
    before = process_state()
    yield
    after = process_state()
    if after != before:
        leaks = state_leaks(before, after)
        restore(before, after)
        pytest.fail(f"{request.node.nodeid} left process-global state behind: {'; '.join(leaks)}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A small Llama-style HF model directory (BPE tokenizer with a chat template + random-init
    LlamaForCausalLM, sharded safetensors), built once per test run by the same builder as
    examples/make_tiny_llama.py."""
    from zerotrain.models.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_shard_size="200KB", corpus_bytes=256 << 10)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)
