"""The same-host transport (zerotrain.comm.same_host): ranks on this machine read each other's
chunks from memory. It must give what the socket path gives, with many collectives in flight
and waited in any order, and end with an error naming the rank when a peer dies or goes silent."""
from __future__ import annotations

import os
import time

import pytest
import torch

from distributed import run_distributed


def _comm(same_host: bool, timeout_seconds: float = 60.0):
    from zerotrain.comm import Comm, CommCounters
    from zerotrain.topology import Topology

    Topology.build()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    return Comm(None, rank, world, CommCounters(), same_host_transport=same_host, timeout_seconds=timeout_seconds)


def many_in_flight(dtype_name: str) -> dict:
    """More collectives in flight than the mailbox has slots, waited in reverse, both transports."""
    from zerotrain.comm.same_host import SLOTS

    dtype = getattr(torch, dtype_name)
    out = {}
    for same_host in (True, False):
        comm = _comm(same_host)
        world, rank = comm.size, comm.rank
        gen = torch.Generator().manual_seed(3 + rank)
        count, chunk = SLOTS * 2 + 5, 257
        sources = [torch.randn(world * chunk, generator=gen).to(dtype) for _ in range(count)]
        handles, results = [], []
        for index, source in enumerate(sources):
            if index % 2:
                result = torch.empty(chunk, dtype=dtype)
                handles.append(comm.reduce_scatter(result, source, async_op=True))
            else:
                result = torch.empty(world * chunk, dtype=dtype)
                handles.append(comm.all_gather(result, source[:chunk], async_op=True))
            results.append(result)
        for handle in reversed(handles):
            handle.wait()
        completed = all(handle.is_completed() for handle in handles)  # torch's Work API, after wait()
        # In place: a reduce-scatter into the input's own chunk, an all-gather from the output's own chunk.
        in_place = sources[0].clone()
        comm.reduce_scatter(in_place[rank * chunk:(rank + 1) * chunk], in_place)
        gathered = torch.zeros(world * chunk, dtype=dtype)
        gathered[rank * chunk:(rank + 1) * chunk] = sources[1][:chunk]
        comm.all_gather(gathered, gathered[rank * chunk:(rank + 1) * chunk])
        out[same_host] = {"results": results, "in_place": in_place[rank * chunk:(rank + 1) * chunk].clone(),
                          "gathered": gathered, "counters": comm.counters.snapshot(),
                          "used": comm._same_host() is not None, "completed": completed}
    return out


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "bfloat16"), (4, "float32")])
def test_same_host_matches_sockets(world, dtype):
    for rank, result in enumerate(run_distributed(many_in_flight, world, dtype, timeout=240)):
        fast, sockets = result[True], result[False]
        assert fast["used"] and not sockets["used"], rank
        assert fast["completed"] and sockets["completed"], rank
        assert fast["counters"] == sockets["counters"], rank
        # Two ranks sum a + b either way (bitwise); more ranks may sum in another order.
        tol = {"rtol": 0, "atol": 0} if world == 2 else {"rtol": 1e-2 if dtype == "bfloat16" else 1e-6, "atol": 1e-5}
        for index, (a, b) in enumerate(zip(fast["results"], sockets["results"])):
            torch.testing.assert_close(a, b, **tol, msg=f"rank {rank} op {index}")
        torch.testing.assert_close(fast["in_place"], sockets["in_place"], **tol)
        torch.testing.assert_close(fast["gathered"], sockets["gathered"], rtol=0, atol=0)


def gather_known_values(environment: dict) -> list:
    os.environ.update(environment)
    comm = _comm(True)
    full = torch.empty(comm.size * 4)
    comm.all_gather(full, torch.full((4,), float(comm.rank)))
    return [comm._same_host() is not None, full.tolist()]


@pytest.mark.parametrize("environment,expected", [({}, True), ({"ZEROTRAIN_SAME_HOST_TRANSPORT": "0"}, False)])
def test_turned_off_by_environment(environment, expected):
    for used, values in run_distributed(gather_known_values, 2, environment):
        assert used == expected
        assert values == [0.0] * 4 + [1.0] * 4


def peer_dies() -> str:
    """Rank 1 dies after the transport is up; rank 0's next all-gather must fail naming rank 1."""
    from zerotrain.comm import CollectiveError

    comm = _comm(True, timeout_seconds=600)
    full = torch.empty(comm.size * 4)
    comm.all_gather(full, torch.ones(4))  # sets the transport up on both ranks
    if comm.rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        comm.all_gather(full, torch.ones(4))
    except CollectiveError as error:
        return f"{time.monotonic() - start:.1f} {error}"
    return "no error"


def test_dead_peer_is_named_not_waited_for():
    results = run_distributed(peer_dies, 2, expect_exit={1}, timeout=120)
    seconds, message = results[0].split(" ", 1)
    assert "rank(s) [1]" in message and "died" in message, message
    assert float(seconds) < 10, message  # found by the liveness check, long before the 600 s timeout


def peer_silent(done_marker: str) -> str:
    """Rank 1 stays alive but never joins the collective: rank 0 times out naming the wait. Rank 1 lives
    until rank 0 has its answer (the marker file), 8 s at most."""
    from zerotrain.comm import CollectiveError

    comm = _comm(True, timeout_seconds=2)
    full = torch.empty(comm.size * 4)
    comm.all_gather(full, torch.ones(4))
    if comm.rank == 1:
        deadline = time.monotonic() + 8
        while not os.path.exists(done_marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:
        comm.all_gather(full, torch.ones(4))
    except CollectiveError as error:
        return str(error)
    finally:
        open(done_marker, "w").close()
    return "no error"


def test_silent_peer_times_out(tmp_path):
    message = run_distributed(peer_silent, 2, str(tmp_path / "rank0_done"), expect_exit={1}, timeout=120)[0]
    assert "within 2 s" in message and "rank 0 of 2" in message, message


def engine_with_transport(same_host: bool, stage: int) -> dict:
    import zerotrain
    from models_for_tests import OddMLP, make_batches, train_global_step

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}, "comm_same_host_transport": same_host}
    engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=config)
    losses = [train_global_step(engine, batch, micro=2) for batch in make_batches(3, 8)]
    return {"used": engine.comm._same_host() is not None, "losses": losses,
            "weights": {name: tensor.clone() for name, tensor in engine.full_state_dict().items()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_config_key_and_parity(stage):
    from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training

    ref_losses, ref_weights = reference_training(OddMLP, make_batches(3, 8))
    for same_host in (True, False):
        result = run_distributed(engine_with_transport, 2, same_host, stage)[0]
        assert result["used"] == same_host
        assert_same_training(result["losses"], result["weights"], ref_losses, ref_weights)


def test_siblings_allowed_only_under_yama_scope_1_with_one_parent():
    from zerotrain.comm.same_host import allow_siblings

    assert not allow_siblings(None, [10, 10])  # no Yama: nothing to allow
    assert not allow_siblings(0, [10, 10])  # classic ptrace permissions already allow same-uid reads
    assert not allow_siblings(2, [10, 10])  # admin-only: a prctl would not help
    assert not allow_siblings(1, [10, 11])  # no common parent to name
    assert allow_siblings(1, [os.getppid()] * 2)  # issues the prctl (a no-op on a kernel without Yama)


def test_a_peer_that_exited_counts_as_dead_before_it_is_reaped():
    """The liveness check a waiting rank runs: a peer that exited but whose parent (torchrun's agent) has not
    reaped it yet is a zombie in /proc, and must count as dead, as a gone pid does; a running one is alive."""
    import subprocess

    from zerotrain.comm.same_host import _alive

    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while _alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: state Z
        time.sleep(0.01)
    assert not _alive(child.pid)
    with open(f"/proc/{child.pid}/stat") as file:
        assert file.read().rsplit(")", 1)[1].split()[0] == "Z"  # still there, as a zombie
    child.wait()
    assert not _alive(child.pid) and _alive(os.getpid())
