"""2 nodes x 2 ranks over network namespaces (tests/multinode/netns.py): ZeRO-3 and ZeRO-3 + hpZ train as one
process does, the node-aware layout holds (same-host transport only inside a node, hpZ's secondary partition
inside a node, one tokenization per node, the NVMe swap path node-local), and the checkpoint the 2-node job saves loads on one node and
continues exactly. One 4-rank launch and one 2-rank launch."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

import netns
from distributed import run_distributed

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

STEPS = 3  # the 2-node job's steps; the 1-node job continues with one more


NVME = "/dev/shm/nvme"  # the same path on every node, each node's own (private) file system


def _config(hpz: int, nvme: bool = False) -> dict:
    offload = {"offload_param": {"device": "nvme", "nvme_path": NVME, "buffer_count": 2}} if nvme else {}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // int(os.environ["WORLD_SIZE"]),
            "gradient_clipping": 1.0, "comm_timeout_seconds": 60,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0,
                                  "zero_hpz_partition_size": hpz, **offload}}


def _train(hpz: int, batches, nvme: bool = False) -> tuple:
    import zerotrain
    from models_for_tests import OddMLP, train_global_step

    torch.manual_seed(0)
    engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=_config(hpz, nvme))
    losses = [train_global_step(engine, batch, micro=2) for batch in batches]
    return engine, losses


def two_node_job(pids: list, save_dir: str, data_file: str, tokenizer_dir: str) -> dict:
    from models_for_tests import make_batches
    from zerotrain.comm import Comm, CommCounters
    from zerotrain.data.tokenization import tokenize_files
    from zerotrain.topology import Topology

    node = netns.join_as_rank(pids, 2)
    batches = make_batches(STEPS, 8)
    out: dict = {"node": node}
    for hpz in (1, 2):
        engine, losses = _train(hpz, batches)
        out[hpz] = {"losses": losses, "weights": {k: v.clone() for k, v in engine.full_state_dict().items()}}
        if hpz == 2:
            engine.save_checkpoint(save_dir, tag="two_nodes")
            out["world_same_host"] = engine.comm._same_host() is not None  # spans both nodes: sockets
    engine, losses = _train(1, batches, nvme=True)  # parameters swapped to a node-local "NVMe" path
    out["nvme"] = {"losses": losses, "weights": {k: v.clone() for k, v in engine.full_state_dict().items()},
                   "swap": sorted(name.split("-")[2] for name in os.listdir(NVME))}  # this node's ranks' directories
    torch.distributed.barrier()  # every rank has looked before any removes its swap directory
    engine.close()
    topology = Topology.build()
    group, rank, size = topology.partition_group(2)  # hpZ's secondary partition: this node's two ranks
    inside = Comm(group, rank, size, CommCounters(), timeout_seconds=60)
    gathered = torch.empty(2)
    inside.all_gather(gathered, torch.tensor([float(topology.rank)]))
    out["node_group"] = gathered.tolist()
    out["node_same_host"] = inside._same_host() is not None
    from transformers import AutoTokenizer
    tokenized = tokenize_files([data_file], AutoTokenizer.from_pretrained(tokenizer_dir), cache_dir="/dev/shm/cache",
                               comm=Comm(None, topology.rank, topology.world_size, CommCounters(), timeout_seconds=60))
    out["tokenized"] = (tokenized.cache_hit, tokenized.num_tokens)
    return out


def one_node_resume(pids: list, save_dir: str) -> dict:
    import zerotrain
    from models_for_tests import OddMLP, make_batches, train_global_step

    netns.join_as_rank(pids[:1] * 2, 2)  # both ranks on node 0
    torch.manual_seed(0)
    engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=_config(1))
    engine.load_checkpoint(save_dir, tag="two_nodes")
    loaded = {k: v.clone() for k, v in engine.full_state_dict().items()}
    loss = train_global_step(engine, make_batches(STEPS + 1, 8)[STEPS], micro=2)
    return {"loaded": loaded, "loss": loss, "weights": engine.full_state_dict()}


def test_two_nodes_train_as_one_process_and_the_checkpoint_loads_on_one_node(tmp_path, tiny_llama_dir):
    from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training

    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "document {i} about nodes and links"}}\n' for i in range(20)))
    save_dir = str(tmp_path / "ckpt")  # shared by both nodes (the same file system), as a checkpoint dir must be
    with netns.two_nodes() as nodes:
        pids = [node.pid for node in nodes.nodes]
        sent_before = nodes.link_bytes()
        results = run_distributed(two_node_job, 4, pids, save_dir, str(data), str(tiny_llama_dir), timeout=240)
        sent = [after - before for after, before in zip(nodes.link_bytes(), sent_before)]
        resumed = run_distributed(one_node_resume, 2, pids, save_dir, timeout=180)
    ref_losses, ref_weights = reference_training(OddMLP, make_batches(STEPS + 1, 8))
    for rank, result in enumerate(results):
        assert result["node"] == rank // 2
        for hpz in (1, 2):  # the whole weights come back on rank 0
            assert_same_training(result[hpz]["losses"], result[hpz]["weights"] if rank == 0 else {},
                                 ref_losses[:STEPS], _weights_after(STEPS) if rank == 0 else {},
                                 where=f"rank {rank} hpz {hpz}")
        assert_same_training(result["nvme"]["losses"], result["nvme"]["weights"] if rank == 0 else {},
                             ref_losses[:STEPS], _weights_after(STEPS) if rank == 0 else {}, where=f"rank {rank} nvme")
        assert result["nvme"]["swap"] == [f"r{2 * (rank // 2)}", f"r{2 * (rank // 2) + 1}"], result["nvme"]["swap"]
        assert not result["world_same_host"], rank  # never through shared memory across the link
        assert result["node_same_host"], rank  # the node's own ranks do read each other's memory
        assert result["node_group"] == [2.0 * (rank // 2), 2.0 * (rank // 2) + 1], rank  # within the node
    built = [r["tokenized"][0] is False for r in results]
    assert built == [True, False, True, False], built  # local rank 0 of each node tokenized, the other waited
    assert len({r["tokenized"][1] for r in results}) == 1
    assert min(sent) > 100_000, sent  # the ranks talked over the link (tx bytes of each node's end)
    torch.testing.assert_close(resumed[0]["loaded"], results[0][2]["weights"], rtol=0, atol=0)
    for rank, result in enumerate(resumed):
        assert_same_training([result["loss"]], result["weights"] if rank == 0 else {}, ref_losses[STEPS:],
                             ref_weights if rank == 0 else {}, where=f"one-node rank {rank}")
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        f"ztmn{os.getpid()}x") == 0  # torn down


_REFERENCE: dict = {}


def _weights_after(steps: int) -> dict:
    from models_for_tests import OddMLP, make_batches, reference_training

    if steps not in _REFERENCE:
        _REFERENCE[steps] = reference_training(OddMLP, make_batches(steps, 8))[1]
    return _REFERENCE[steps]


def test_nodes_are_torn_down_when_the_body_fails_and_leftovers_of_a_dead_run_are_removed():
    def ours() -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [name for name in listed if name.startswith("ztmn")]

    with pytest.raises(RuntimeError, match="a failing test"):
        with netns.two_nodes(rate="100mbit") as nodes:
            holders = [node.pid for node in nodes.nodes]
            assert len([name for name in ours() if name.startswith(f"ztmn{os.getpid()}x")]) == 2
            raise RuntimeError("a failing test")
    assert not [name for name in ours() if name.startswith(f"ztmn{os.getpid()}x")]
    assert not [pid for pid in holders if os.path.exists(f"/proc/{pid}")]
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the creator of a crashed run's namespace
    leftover = f"ztmn{gone.pid}x0n0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        assert leftover in netns.clean_leftovers()
        assert leftover not in ours()
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)
