#!/usr/bin/env python
"""ZeRO-3, ZeRO++, DDP and FSDP2 (HSDP) across two "nodes" joined by a shaped link: step time, inter-node bytes,
and a bytes + compute model of every step time.

Two nodes are built on this machine as in the multi-node tests (tests/multinode/netns.py: two network
namespaces joined by a veth pair, each node with its own hostname and /dev/shm), two ranks on each (gloo over
the link between nodes, zerotrain's same-host transport inside a node). This kernel has no netem: the link gets a
bandwidth (a token-bucket qdisc, `tc ... tbf`, on both ends) but **no added latency**.

One launch of 4 ranks trains the same GPT (fixed B*T per rank: `--batch` x `--seq-len` tokens, fp32, one compute
thread per rank) with each variant in turn, the same seeded init and batches:

  zt3        zerotrain ZeRO-3
  hpz        + hpZ (zero_hpz_partition_size = ranks per node: backward's gather stays inside a node)
  hpz+qwz    + qwZ (forward's gather int8)
  zpp        + qgZ (gradients reduced int4, inside a node first)            = ZeRO++ without LoCo
  zpp+loco   + LoCo (zeropp_loco_param: error feedback of the int4 reduce) = ZeRO++ with LoCo
  ddp        torch's DistributedDataParallel (gradients all-reduced over all 4 ranks, by gloo's ring)
  hsdp       torch's FSDP2 `fully_shard` on a 2-D DeviceMesh (replicate across nodes, shard within a node: HYBRID_SHARD,
             torchtitan's HSDP): gathers and reduce-scatters inside a node, the gradient shards all-reduced across
  ds3        DeepSpeed ZeRO-3 (stage 3 alone); ds3pp, DeepSpeed with hpZ + qwZ + qgZ, does not run on CPU (its
             quantizer kernels are CUDA-only) and is not in the default list
DDP and FSDP2 use torch's AdamW and clip_grad_norm_ (1.0), as the engines' config does.

Every variant, after one warm-up step on the bare link, runs `--steps` timed steps at each of `--rates` in turn
(each node's local rank 0 reshapes its end of the link between them): "none" (the bare veth), a fixed rate
("1gbit"), or "ratioR": the rate at which ZeRO-3's inter-node traffic takes R seconds per second of its compute,
derived in the run from the first variant's (zt3's) bare-link step and bytes (benchmarks/RESULTS_multinode.md: a
GPU cluster at B*T = 64 tokens per rank has R ~ 100). Per variant and rate: the median step time (slowest rank;
ranks start each step together after a barrier), the bytes that crossed the link per step (the veth's tx counters
of both nodes: payload plus TCP/IP headers), both as ratios to zt3, and beside the step time its model:

  model = compute + (replay(profile, rate) - replay(profile, bare))      (the larger of the two nodes)
    compute = the same variant's step on the bare link (measured, unshaped; the median)
    profile = one more bare-link step of the variant, sampled every 0.5 ms on each node: the bytes its veth sent and
              received so far, and whether the rank's compute thread runs or sleeps (waits on a transfer)
    replay  = that step replayed through a FIFO link of the rate each way: what is sent or received between two
              samples joins the queue when the replay reaches it; compute intervals take their bare time beside the
              queues, a wait lasts until its bare time has passed and the queues are empty (`replay_seconds`)

So each variant keeps its own overlap, measured, not assumed: zerotrain's prefetched gathers and reductions on its
transport threads, DDP's one large bucket that is ready only at the end of backward, DeepSpeed's per-module gathers
that the next module waits on. Nothing in it is fitted to a shaped step. Beside it, compute + link (nothing
overlapped, the busier node's bytes sent / the rate) is an upper bound. (The first version of the model,
serial + max(compute - serial, link) with the optimizer step as the only serial part, missed gloo's ring
collectives by 17-36% at 1 Gbit/s: RESULTS_multinode.md.)
After the last rate every variant evaluates the same held-out batches (mean loss over ranks and batches, and its
standard error): ZeRO++ with LoCo must stay within one standard error of exact ZeRO-3's (the LoCo rule).

Theory for the bytes that cross (fp32, Psi = 4 bytes x parameters, 2 nodes x 2 ranks): zerotrain's gloo
reduce-scatter and all-gather send every peer its chunk directly, so of each rank's (N-1)/N Psi sent per collective
half goes to the other node: 2 Psi cross per collective, and ZeRO-3's forward gather, backward gather and gradient
reduce make 6 Psi a step. hpZ keeps the backward gather inside the node (4 Psi); qwZ makes the forward gather int8
(0.5 Psi, plus a scale per 2048 values); qgZ reduces int4 in two hops, inside the node first, after which each rank
sends the other node a quarter of the gradient in int4 (Psi/8 in all). gloo's own collectives are rings over ranks
0-3, which cross the link twice: DeepSpeed's 1.5 Psi a collective, 4.5 Psi a step; DDP's all-reduce sends
2 (N-1)/N Psi = 1.5 Psi per ring hop, 3 Psi across. HSDP all-reduces each rank's half (Psi/2) with its twin on the
other node (a ring of 2: Psi/2 sent each), 2 Psi across. The measured bytes add TCP/IP headers (~3%), qwZ/qgZ's
scales and the small persistent parameters' all-reduce.

Needs root (ip netns, tc, nsenter). Run on a quiet machine (the step times are CPU-bound inside each node):

    sudo .venv/bin/python benchmarks/multinode.py --json out.json       # none, 1gbit, ratio100 (<= 10 min quiet)
    sudo .venv/bin/python benchmarks/multinode.py --rates none,ratio100 --variants zt3,zpp+loco,ddp,hsdp
    .venv/bin/python benchmarks/multinode.py --render out.json            # the table again, from the raw results
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multinode"))
import netns  # noqa: E402  (the tests' two-node harness: namespaces, veth, teardown)

WORLD, PER_NODE, SEED, LR, CLIP = 4, 2, 1234, 1e-4, 1.0
ZPP = {"zero_hpz_partition_size": PER_NODE, "zero_quantized_weights": True, "zero_quantized_gradients": True}
VARIANTS: dict[str, tuple[str, dict]] = {
    # name -> (engine, zero_optimization)
    "zt3": ("zerotrain", {"stage": 3}),
    "hpz": ("zerotrain", {"stage": 3, "zero_hpz_partition_size": PER_NODE}),
    "hpz+qwz": ("zerotrain", {"stage": 3, "zero_hpz_partition_size": PER_NODE, "zero_quantized_weights": True}),
    "zpp": ("zerotrain", {"stage": 3, **ZPP}),
    "zpp+loco": ("zerotrain", {"stage": 3, **ZPP, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}),
    "ddp": ("ddp", {}),
    "hsdp": ("fsdp2", {}),
    "ds3": ("deepspeed", {"stage": 3}),
    "ds3pp": ("deepspeed", {"stage": 3, **ZPP}),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "ds3pp"]
# bytes crossing the link per step, in units of Psi (fp32 parameter bytes): see the module docstring
THEORY = {"zt3": 6.0, "hpz": 4.0, "hpz+qwz": 2.5, "zpp": 0.625, "zpp+loco": 0.625, "ddp": 3.0, "hsdp": 2.0,
          "ds3": 4.5, "ds3pp": 0.625}
MODEL_TOLERANCE = 0.15  # every measured step within 15% of its model (issue #34)


def _link_tx() -> int:
    return int(Path(f"/sys/class/net/{netns.LINK}/statistics/tx_bytes").read_text())


class _SendProfile(threading.Thread):
    """Samples, every `period` s while running, this node's link counters (bytes sent and received on the veth) and
    whether the rank's main (compute) thread is running or asleep (waiting on a transfer): the send profile of one
    bare-link step, replayed through a shaped link by `replay_seconds`. One per node (its local rank 0: both ranks of
    a node share the veth). Reads are pread()s of sysfs and /proc: a few microseconds each, no GIL held for long."""

    def __init__(self, period: float = 5e-4):
        super().__init__(daemon=True)
        self.period, self.samples, self._stop_event = period, [], threading.Event()
        self._main = threading.get_native_id()

    def run(self) -> None:
        stats = f"/sys/class/net/{netns.LINK}/statistics/"
        fds = [os.open(stats + "tx_bytes", os.O_RDONLY), os.open(stats + "rx_bytes", os.O_RDONLY),
               os.open(f"/proc/self/task/{self._main}/stat", os.O_RDONLY)]
        try:
            while not self._stop_event.is_set():
                now = time.perf_counter()
                tx, rx = int(os.pread(fds[0], 32, 0)), int(os.pread(fds[1], 32, 0))
                state = os.pread(fds[2], 512, 0).rsplit(b")", 1)[1].split()[0]  # R running/runnable, S/D waiting
                self.samples.append((now, tx, rx, state == b"R"))
                time.sleep(self.period)
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self, started: float) -> list[tuple[float, int, int, bool]]:
        """The samples, times from `started`, byte counts from the first sample."""
        self._stop_event.set()
        self.join()
        first = self.samples[0]
        return [(t - started, tx - first[1], rx - first[2], running) for t, tx, rx, running in self.samples]


def replay_seconds(profile: list, bits: Optional[float], scale: float = 1.0) -> float:
    """One node's bare-link step replayed through a link of `bits`/s each way (a fluid FIFO per direction).

    Between two samples of `profile` (`_SendProfile`: seconds, cumulative bytes sent and received, main thread
    running) the bytes sent and received join their direction's queue when the replayed step reaches that point. An
    interval in which the main thread ran is compute: it takes its bare-link time whatever the queues hold (the
    transfers run beside it: prefetched gathers, async reductions, DDP's buckets during backward). An interval in
    which it slept is a wait on a transfer: it ends when its bare-link time has passed and both queues are empty
    (everything issued so far has crossed: the link is FIFO, and what the step waits on was issued before the wait
    ended). With bits None (the bare link) the replay is the profiled step itself. `scale` multiplies the bytes (the
    shaped link's measured bytes over the bare link's: TCP retransmits). Measures no shaped step: it predicts one."""
    clock = sent_done = received_done = 0.0
    wait_started = None  # the replayed and the bare start of the wait under way: (clock, profile seconds)
    previous = (0.0, 0, 0, True)
    for sample in profile:
        seconds = sample[0] - previous[0]
        running = sample[3] and previous[3]  # asleep at either end: the interval holds a wait
        if not running:
            wait_started = wait_started or (clock, previous[0])
        # when this interval's bytes were issued, replayed: by the compute as it reaches them, or, in a wait, by the
        # transfer threads at their bare pace from the wait's start (not held back by the replayed wait)
        issued = clock if running else wait_started[0] + previous[0] - wait_started[1]
        if bits is not None:
            sent_done = max(sent_done, issued) + (sample[1] - previous[1]) * scale * 8 / bits
            received_done = max(received_done, issued) + (sample[2] - previous[2]) * scale * 8 / bits
        if running:
            clock, wait_started = clock + seconds, None
        else:  # a wait lasts as long as the bare one (from its start) or until the queues are empty
            clock = max(wait_started[0] + sample[0] - wait_started[1], sent_done, received_done)
        previous = sample
    return max(clock, sent_done, received_done) if bits is not None else clock


def _bits(rate: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower()).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def _ratio(rate: str) -> Optional[float]:
    """R of a "ratioR" rate (seconds of ZeRO-3's link traffic per second of its compute), else None."""
    match = re.fullmatch(r"ratio([\d.]+)", rate)
    return float(match.group(1)) if match else None


def _shape(bits: Optional[float]) -> None:
    """This node's end of the link (run by its local rank 0, inside the node): a token bucket at `bits`/s, or bare."""
    if bits is None:
        subprocess.run(["tc", "qdisc", "del", "dev", netns.LINK, "root"], capture_output=True)
        return
    # a bucket of ~4 ms of traffic, at least 64 KiB (one GSO packet): small, because a full bucket passes at the
    # veth's speed, and it refills in every pause of the link (a 256 KiB bucket at 15 Mbit/s was 0.14 s of free link)
    burst = max(64 * 1024, int(bits / 8 / 250))
    subprocess.run(["tc", "qdisc", "replace", "dev", netns.LINK, "root", "tbf", "rate", f"{int(bits)}bit",
                    "burst", str(burst), "latency", "100ms"], check=True, capture_output=True)


def _model(args):
    import torch
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(SEED)
    return GPT(GPTConfig.preset(args["model"], block_size=args["seq_len"]))


def _batches(args: dict, rank: int, count: int, stream: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(SEED * 100 + rank + 7919 * stream)
    tokens = torch.randint(0, 256, (count, args["batch"], args["seq_len"] + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


class _Trainer:
    """One variant's training: `step(x, y)` (forward, backward, optimizer step; the loss and the seconds of each
    phase), `evaluate(x, y)` (the loss, no update) and `close()`."""

    def __init__(self, step: Callable, evaluate: Callable, close: Callable):
        self.step, self.evaluate, self.close = step, evaluate, close


def _evaluator(model) -> Callable:
    """`evaluate(x, y)`: the loss of `model` (an engine, or DDP/FSDP2 around the GPT) in eval mode, no update."""
    import torch

    def evaluate(x, y) -> float:
        model.eval()
        with torch.no_grad():
            loss = model(x, y)[1]
        model.train()
        return float(loss)

    return evaluate


def _engine_trainer(engine, close: Callable) -> _Trainer:
    def step(x, y) -> tuple[float, list[float]]:
        marks = [time.perf_counter()]
        loss = engine(x, y)[1]
        marks.append(time.perf_counter())
        engine.backward(loss)
        marks.append(time.perf_counter())
        engine.step()
        marks.append(time.perf_counter())
        return float(loss.detach()), [b - a for a, b in zip(marks, marks[1:])]

    return _Trainer(step, _evaluator(engine), close)


def _torch_trainer(module, model) -> _Trainer:
    """`module` (DDP or FSDP2 around `model`) with torch's AdamW and gradient clipping."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y) -> tuple[float, list[float]]:
        marks = [time.perf_counter()]
        loss = module(x, y)[1]
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        return float(loss.detach()), [b - a for a, b in zip(marks, marks[1:])]

    return _Trainer(step, _evaluator(module), lambda: None)


def _trainer(name: str, args: dict) -> _Trainer:
    kind, zero = VARIANTS[name]
    model = _model(args)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return _torch_trainer(DistributedDataParallel(model), model)  # the GPT has no buffers to sync
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # HSDP: dim 0 replicates across the nodes ({0, 2}, {1, 3}), dim 1 shards within a node ({0, 1}, {2, 3})
        mesh = init_device_mesh("cpu", (WORLD // PER_NODE, PER_NODE), mesh_dim_names=("replicate", "shard"))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # gloo has no ReduceOp.AVG: sum, and divide locally
                module.set_force_sum_reduction_for_comms(True)
        return _torch_trainer(model, model)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": args["batch"], "gradient_accumulation_steps": 1,
                              "gradient_clipping": CLIP, "zero_optimization": dict(zero)}
    if kind == "zerotrain":
        import zerotrain

        config.update(optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, comm_timeout_seconds=600)
        engine, _, _, _ = zerotrain.initialize(model=model, config=config)
        return _engine_trainer(engine, engine.close)
    import deepspeed

    config.update(optimizer={"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}, steps_per_print=10 ** 9)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return _engine_trainer(engine, engine.destroy)


def _run_variant(name: str, spec: dict, rank: int, derived: dict) -> dict:
    """Warm-up on the bare link, `steps` timed steps per rate, the held-out loss. `derived` (rate -> bits/s of the
    ratioR rates) is filled by the first variant, from its own bare-link step."""
    import torch
    import torch.distributed as dist

    args = spec["args"]
    local_first = int(os.environ["LOCAL_RANK"]) == 0
    trainer = _trainer(name, args)
    profiled = "none" in spec["rates"]
    batches = iter(_batches(args, rank, args["warmup"] + sum(args["steps"]) + profiled, 0))
    losses = []
    if local_first:
        _shape(None)
    for _ in range(args["warmup"]):
        losses.append(trainer.step(*next(batches))[0])
    rates: dict[str, dict] = {}
    for rate, steps in zip(spec["rates"], args["steps"]):
        if rate == "none":
            bits = None
        elif _ratio(rate) is not None:
            if rate not in derived:
                raise RuntimeError(f"{rate}: derived from the first variant's bare-link step; put 'none' first")
            bits = derived[rate]
        else:
            bits = _bits(rate)
        dist.barrier()
        if local_first:
            _shape(bits)
        dist.barrier()
        tx_start = _link_tx() if local_first else 0
        times, phases = [], []
        for _ in range(steps):
            dist.barrier()
            started = time.perf_counter()
            loss, phase = trainer.step(*next(batches))
            times.append(time.perf_counter() - started)
            losses.append(loss)
            phases.append(phase)
        dist.barrier()
        tx = (_link_tx() - tx_start) if local_first else 0
        rates[rate] = {"times": times, "phases": phases, "tx": tx, "bits": bits}
        if rate == "none":  # one more bare step, profiled (its own step: the sampler must not touch the timed ones)
            sampler = _SendProfile() if local_first else None
            dist.barrier()
            started = time.perf_counter()
            if sampler:
                sampler.start()
            loss, _ = trainer.step(*next(batches))
            rates[rate]["profile_s"] = time.perf_counter() - started
            losses.append(loss)
            if sampler:
                rates[rate]["profile"] = sampler.stop(started)
            dist.barrier()
        if rate == "none" and not derived:  # the first variant sets the ratioR rates from its own compute and bytes
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            nodes = torch.zeros(WORLD // PER_NODE, dtype=torch.float64)
            nodes[rank // PER_NODE] = tx
            dist.all_reduce(nodes)
            compute, busiest = statistics.median(slowest.tolist()), float(nodes.max()) / steps
            for other in spec["rates"]:
                if _ratio(other) is not None:
                    derived[other] = busiest * 8 / (_ratio(other) * compute)
    dist.barrier()
    if local_first:
        _shape(None)
    held = torch.zeros(WORLD, args["eval_batches"], dtype=torch.float64)
    for index, (x, y) in enumerate(_batches(args, rank, args["eval_batches"], 1)):
        held[rank, index] = trainer.evaluate(x, y)
    dist.all_reduce(held)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    trainer.close()
    return {"status": "ok", "rates": rates, "loss": (mean / WORLD).tolist(), "held_out": held.flatten().tolist(),
            "derived": dict(derived)}


def worker(spec: dict) -> int:
    """One rank: every variant in turn; the results to spec['out']."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    results: dict[str, Any] = {}
    derived: dict[str, float] = {}
    for name in spec["variants"]:
        try:
            results[name] = _run_variant(name, spec, rank, derived)
        except Exception as error:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
            results[name] = {"status": "failed", "reason": f"{type(error).__name__}: {str(error).splitlines()[0]}",
                             "traceback": traceback.format_exc()}
            Path(spec["out"]).write_text(json.dumps(results))
            break  # the other ranks may be stuck in a collective of this variant: end the launch
        Path(spec["out"]).write_text(json.dumps(results))
        if rank == 0:
            print(f"{name}: " + ", ".join(f"{rate} {statistics.median(cell['times']):.2f} s"
                                          for rate, cell in results[name]["rates"].items()), flush=True)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed leaves threads behind that keep a plain exit waiting


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nodes: "netns.Nodes", spec: dict, workdir: Path, timeout: float) -> list[dict]:
    """4 ranks (2 per node) running `spec`; each rank's results."""
    port, procs, outs = _free_port(), [], []
    for rank in range(WORLD):
        node = nodes[rank // PER_NODE]
        out = workdir / f"rank{rank}.json"
        out.unlink(missing_ok=True)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                   LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(node.index), MASTER_ADDR=nodes[0].address,
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        log = open(workdir / f"rank{rank}.log", "w")
        argv = [sys.executable, __file__, "--_worker", json.dumps({**spec, "out": str(out)})]
        procs.append(subprocess.Popen(node.command(argv), env=env, stdout=None if rank == 0 else log,
                                      stderr=log))
        outs.append(out)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:  # a rank stuck in a collective, or an interrupt: every rank goes
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(out.read_text()) if out.exists() else {} for out in outs]


def merge(ranks: list[dict], name: str, rates: list[str], counts: list[int]) -> dict:
    """One variant: per rate the slowest rank per step, the link bytes per step (both nodes); the held-out loss."""
    mine = [r.get(name) for r in ranks]
    failed = [m for m in mine if m and m["status"] != "ok"]
    if failed or not all(mine):
        return {"status": "failed",
                "reason": failed[0]["reason"] if failed else "did not run (timeout or an earlier failure)"}
    cells = {}
    for rate, steps in zip(rates, counts):
        per_rank = [m["rates"][rate] for m in mine]
        slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]
        # forward, backward, optimizer step: each the slowest rank's, median over the steps
        phases = [statistics.median(max(r["phases"][i][k] for r in per_rank) for i in range(steps)) for k in range(3)]
        tx_nodes = [sum(r["tx"] for r in per_rank[n * PER_NODE:(n + 1) * PER_NODE]) / steps
                    for n in range(WORLD // PER_NODE)]
        cells[rate] = {"step_s": statistics.median(slowest), "steps_s": slowest, "link_bytes": sum(tx_nodes),
                       "busiest_node_bytes": max(tx_nodes), "node_bytes": tx_nodes, "bits": per_rank[0]["bits"],
                       "phases_s": phases}
        if rate == "none":  # each node's profiled step (its local rank 0's samples), up to the step's end
            ends = [r["profile_s"] for r in per_rank]
            cells[rate]["profiles"] = [[s for s in per_rank[n * PER_NODE]["profile"] if s[0] <= max(ends)]
                                       for n in range(WORLD // PER_NODE)]
            cells[rate]["profile_s"] = max(ends)
    held = mine[0]["held_out"]
    return {"status": "ok", "rates": cells, "loss": mine[0]["loss"][-1], "held_out": statistics.mean(held),
            "held_out_se": statistics.stdev(held) / math.sqrt(len(held)) if len(held) > 1 else float("nan")}


def _rate_label(rate: str, bits: Optional[float]) -> str:
    if bits is None or _ratio(rate) is None:
        return rate
    return f"{rate} = {bits / 1e6:.1f} Mbit/s"


def _link_seconds(table: dict, name: str, rate: str) -> Optional[tuple[float, float]]:
    """(compute, link seconds) of `name`'s step at `rate`: the variant's step on the bare link, and the busier node's
    bytes sent per step / the rate. None without a bare-link measurement."""
    cell = table[name]
    if cell["status"] != "ok" or "none" not in cell["rates"]:
        return None
    here, bare = cell["rates"][rate], cell["rates"]["none"]
    link = 0.0 if here["bits"] is None else here["busiest_node_bytes"] * 8 / here["bits"]
    return bare["step_s"], link


def model_seconds(table: dict, name: str, rate: str) -> Optional[float]:
    """The bytes + compute model of `name`'s step at `rate`: its bare-link step (the median) plus what the link adds
    when the profiled bare-link step is replayed through it (`replay_seconds`, per node, the larger).

    The replay keeps every variant's own overlap: transfers issued while the compute thread runs cross beside it,
    a wait lasts until what was issued before it has crossed. So it tells apart DDP, whose one large bucket is ready
    only at the end of backward, and DeepSpeed's per-module gathers, which the next module waits on, from zerotrain's
    prefetched gathers and reductions, with no constant fitted to any shaped step."""
    cell = table[name]
    parts = _link_seconds(table, name, rate)
    if parts is None or not cell["rates"]["none"].get("profiles"):
        return None
    compute, _ = parts
    here, bare = cell["rates"][rate], cell["rates"]["none"]
    if here["bits"] is None:
        return compute
    added = []
    for node, profile in enumerate(bare["profiles"]):
        scale = here["node_bytes"][node] / max(1, profile[-1][1])  # the bytes at this rate / the profiled step's
        added.append(replay_seconds(profile, here["bits"], scale) - replay_seconds(profile, None))
    return compute + max(added)


def no_overlap_seconds(table: dict, name: str, rate: str) -> Optional[float]:
    """compute + link: the step if nothing overlapped (an upper bound)."""
    parts = _link_seconds(table, name, rate)
    return None if parts is None else parts[0] + parts[1]


def verdicts(table: dict, rates: list[str]) -> list[str]:
    """The issue's targets, each met or not, in words."""
    lines = []
    base, zpp = table.get("zt3", {}), table.get("zpp+loco", {})
    if base.get("status") == "ok" and zpp.get("status") == "ok":
        for rate in rates:
            ratio = zpp["rates"][rate]["link_bytes"] / base["rates"][rate]["link_bytes"]
            step = zpp["rates"][rate]["step_s"] / base["rates"][rate]["step_s"]
            lines.append(f"- {rate}: ZeRO++ (zpp+loco) link bytes {ratio:.2f}x ZeRO-3's (target <= 0.3: "
                         f"{'met' if ratio <= 0.3 else 'MISSED'}); step {step:.2f}x"
                         + (f" (target <= 0.75 on this link: {'met' if step <= 0.75 else 'MISSED'})"
                            if _ratio(rate) is not None else ""))
        delta = zpp["held_out"] - base["held_out"]
        lines.append(f"- held-out loss: ZeRO++ with LoCo {zpp['held_out']:.4f} vs ZeRO-3 {base['held_out']:.4f} "
                     f"(delta {delta:+.4f}; LoCo rule: within one standard error of exact's mean, "
                     f"{base['held_out_se']:.4f}: {'met' if abs(delta) <= base['held_out_se'] else 'MISSED'})")
    misses = []
    for name, cell in table.items():
        if cell["status"] != "ok":
            continue
        for rate in rates:
            model = model_seconds(table, name, rate)
            if model and rate != "none" and abs(cell["rates"][rate]["step_s"] / model - 1) > MODEL_TOLERANCE:
                misses.append(f"{name} at {rate} ({cell['rates'][rate]['step_s'] / model:.2f})")
    lines.append(f"- bytes + compute model within {MODEL_TOLERANCE:.0%} of every shaped step: "
                 + ("met" if not misses else "MISSED by " + ", ".join(misses)))
    return lines


def render(saved: dict) -> str:
    table, rates, args, psi = saved["table"], saved["rates"], saved["args"], saved["psi"]
    load = saved.get("load", (float("nan"), float("nan")))
    lines = [f"GPT {args['model']} ({psi // 4 / 1e6:.2f}M parameters, Psi = {psi / 1e6:.1f} MB fp32), 2 nodes x 2 ranks, "
             f"B*T per rank = {args['batch']}x{args['seq_len']}, {args['warmup']} warm-up step, timed steps "
             f"{', '.join(f'{r} {n}' for r, n in zip(rates, args['steps']))}, {args['eval_batches']} held-out "
             f"batches per rank; tbf-shaped veth, no added latency "
             f"(no netem); load average {load[0]:.1f} before, {load[1]:.1f} after",
             "",
             "| rate | variant | step s | / zt3 | model s | step / model | no overlap s | link MB/step | / zt3 | "
             "theory MB | train loss | held-out loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = table.get("zt3", {})
    for rate in rates:
        for name, cell in table.items():
            if cell["status"] != "ok":
                if rate == rates[0]:
                    lines.append(f"| | {name} | {cell['reason'][:90]} | | | | | | | | | |")
                continue
            here = cell["rates"][rate]
            reference = base["rates"][rate] if base.get("status") == "ok" else None
            ratio = (lambda key: f"{here[key] / reference[key]:.2f}" if reference and reference[key] else "")
            model, overlap = model_seconds(table, name, rate), no_overlap_seconds(table, name, rate)
            if here["bits"] is None:  # the bare link: the step is the compute the models start from
                model_cells = "(compute) | "
            else:
                model_cells = "| " if model is None else f"{model:.2f} | {here['step_s'] / model:.2f}"
            lines.append(
                f"| {_rate_label(rate, here['bits'])} | {name} | {here['step_s']:.2f} | {ratio('step_s')} | "
                f"{model_cells} | {'' if overlap is None or here['bits'] is None else f'{overlap:.2f}'} | "
                f"{here['link_bytes'] / 1e6:.1f} | {ratio('link_bytes')} | "
                f"{THEORY[name] * psi / 1e6:.1f} | {cell['loss']:.4f} | {cell['held_out']:.4f} |")
    lines += ["", "model s = compute + what the link adds to the profiled bare-link step replayed through it (per node, "
              "the larger): compute = the variant's step on the bare link (measured, unshaped); the replay keeps the "
              "variant's measured overlap (transfers beside compute, waits until the FIFO link has delivered what was "
              "issued before). no overlap s = compute + the busier node's bytes sent / the rate, an upper bound.", ""]
    return "\n".join(lines + verdicts(table, rates))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,1gbit,ratio100",
                        help="link rates, in order: 'none' (unshaped), a tbf rate ('1gbit', '100mbit'), or 'ratioR' "
                             "(ZeRO-3's link time R x its compute; needs 'none' first)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"known: {', '.join(VARIANTS)}")
    parser.add_argument("--model", default="small", help="zerotrain.models GPT preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", help="timed steps at each rate, e.g. 3,3,1 (one number: at every rate); default "
                                        "3 at a fixed rate or none, 1 at a ratioR rate (link-bound: it varies little)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--eval-batches", type=int, default=2, help="held-out batches per rank")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for the whole launch")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--render", metavar="JSON", help="print the table of an earlier --json run; run nothing")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parsed = parser.parse_args(argv)
    if parsed._worker:
        return worker(json.loads(parsed._worker))
    if parsed.render:
        print(render(json.loads(Path(parsed.render).read_text())))
        return 0
    rates, variants = parsed.rates.split(","), parsed.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    bad = [r for r in rates if r != "none" and _ratio(r) is None and not re.fullmatch(r"[\d.]+[kmg]?bit", r.lower())]
    if bad or (any(_ratio(r) is not None for r in rates) and rates[0] != "none"):
        parser.error(f"--rates: {', '.join(bad) or 'a ratioR rate needs none first'} (e.g. none,1gbit,ratio100)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`/kill: tear the nodes down on the way out
    if netns.skip_reason():
        print(f"cannot build two nodes here: {netns.skip_reason()}", file=sys.stderr)
        return 2
    counts = [int(n) for n in parsed.steps.split(",")] if parsed.steps else \
        [1 if _ratio(rate) is not None else 3 for rate in rates]
    if len(counts) == 1:
        counts *= len(rates)
    if len(counts) != len(rates) or min(counts) < 1:
        parser.error(f"--steps: one count, or one per rate ({len(rates)}), each >= 1")
    args = {k: getattr(parsed, k) for k in ("model", "batch", "seq_len", "warmup", "eval_batches")}
    args["steps"] = counts
    psi = 4 * sum(p.numel() for p in _model(args).parameters())
    load_before = os.getloadavg()[0]
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerotrain-multinode-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with netns.two_nodes(shm_size="1g") as nodes:
        ranks = launch(nodes, {"variants": variants, "rates": rates, "args": args}, workdir, parsed.timeout)
    table = {name: merge(ranks, name, rates, counts) for name in variants}
    saved = {"args": args, "psi": psi, "rates": rates, "table": table, "load": (load_before, os.getloadavg()[0]),
             "wall_s": time.monotonic() - started}
    text = render(saved)
    print(text + f"\n\nwall time {saved['wall_s']:.0f} s; rank logs in {workdir}")
    if parsed.json:
        Path(parsed.json).write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
