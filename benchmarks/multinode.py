#!/usr/bin/env python
"""ZeRO-3 and ZeRO++ across two "nodes" joined by a shaped link: step time and inter-node bytes.

Two nodes are built on this machine as in the multi-node tests (tests/multinode/netns.py: two network
namespaces joined by a veth pair, each node with its own hostname and /dev/shm), two ranks on each (gloo over
the link between nodes, zerotrain's same-host transport inside a node). The link is shaped by a token-bucket
qdisc (`tc ... tbf`) on both ends to each `--rates` entry in turn ("none": the bare veth). This kernel has no
netem: the link has a bandwidth but **no added latency**.

Per rate, one launch of 4 ranks trains the same GPT (fixed B*T per rank: `--batch` x `--seq-len` tokens, fp32,
one compute thread per rank) with each variant in turn, the same seeded init and batches:

  zt3        zerotrain ZeRO-3
  hpz        + hpZ (zero_hpz_partition_size = ranks per node: backward's gather stays inside a node)
  hpz+qwz    + qwZ (forward's gather int8)
  zpp        + qgZ (gradients reduced int4, inside a node first)            = ZeRO++ without LoCo
  zpp+loco   + LoCo (zeropp_loco_param: error feedback of the int4 reduce) = ZeRO++ with LoCo
  ds3        DeepSpeed ZeRO-3 (stage 3 alone), and ds3pp DeepSpeed with hpZ + qwZ + qgZ, where they run on CPU

Per variant and rate: the median step time (slowest rank, ranks start each step together after a barrier),
the bytes that crossed the link per step (the veth's tx counters of both nodes, read by each node's local
rank 0 around the timed steps: payload plus TCP/IP headers), both as ratios to zt3, and a bytes + compute model
of the step time: the same variant's step on the bare link plus the busier node's bytes sent / the rate.
Theory for the bytes that cross (fp32, Psi = 4 bytes x parameters, 2 nodes x 2 ranks): zerotrain's gloo
reduce-scatter and all-gather send every peer its chunk directly, so of each rank's (N-1)/N Psi sent per collective
half goes to the other node: 2 Psi cross per collective, and ZeRO-3's forward gather, backward gather and gradient
reduce make 6 Psi a step. hpZ keeps the backward gather inside the node (4 Psi); qwZ makes the forward gather int8
(0.5 Psi, plus a scale per 2048 values); qgZ reduces int4 in two hops, inside the node first, after which each rank
sends the other node a quarter of the gradient in int4 (Psi/8 in all). DeepSpeed on gloo uses gloo's ring
collectives: a ring over ranks 0-3 crosses the link twice, (N-1)/N Psi per crossing per collective, 1.5 Psi a
collective and 4.5 Psi a step (a ring crosses less than the direct exchange: 0.75x). The measured bytes add TCP/IP
headers (~3%), qwZ/qgZ's scales and the small persistent parameters' all-reduce.

Needs root (ip netns, tc, nsenter). Run on a quiet machine (the step times are CPU-bound inside each node):

    sudo .venv/bin/python benchmarks/multinode.py --json out.json       # none, 1gbit, 100mbit (~10 min quiet)
    sudo .venv/bin/python benchmarks/multinode.py --rates none,1gbit --variants zt3,hpz,zpp+loco,ds3   # shorter
    .venv/bin/python benchmarks/multinode.py --render out.json            # the table again, from the raw results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multinode"))
import netns  # noqa: E402  (the tests' two-node harness: namespaces, veth, teardown)

WORLD, PER_NODE, SEED, LR = 4, 2, 1234, 1e-4
ZPP = {"zero_hpz_partition_size": PER_NODE, "zero_quantized_weights": True, "zero_quantized_gradients": True}
VARIANTS: dict[str, tuple[str, dict]] = {
    # name -> (engine, zero_optimization)
    "zt3": ("zerotrain", {"stage": 3}),
    "hpz": ("zerotrain", {"stage": 3, "zero_hpz_partition_size": PER_NODE}),
    "hpz+qwz": ("zerotrain", {"stage": 3, "zero_hpz_partition_size": PER_NODE, "zero_quantized_weights": True}),
    "zpp": ("zerotrain", {"stage": 3, **ZPP}),
    "zpp+loco": ("zerotrain", {"stage": 3, **ZPP, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}),
    "ds3": ("deepspeed", {"stage": 3}),
    "ds3pp": ("deepspeed", {"stage": 3, **ZPP}),
}
# bytes crossing the link per step, in units of Psi (fp32 parameter bytes): see the module docstring
THEORY = {"zt3": 6.0, "hpz": 4.0, "hpz+qwz": 2.5, "zpp": 0.625, "zpp+loco": 0.625, "ds3": 4.5, "ds3pp": 0.625}


def _link_tx() -> int:
    return int(Path(f"/sys/class/net/{netns.LINK}/statistics/tx_bytes").read_text())


def _model(args):
    import torch
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(SEED)
    return GPT(GPTConfig.preset(args["model"], block_size=args["seq_len"]))


def _batches(args: dict, rank: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(SEED * 100 + rank)
    steps = args["warmup"] + args["steps"]
    tokens = torch.randint(0, 256, (steps, args["batch"], args["seq_len"] + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _engine(name: str, args: dict):
    kind, zero = VARIANTS[name]
    model = _model(args)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": args["batch"], "gradient_accumulation_steps": 1,
                              "gradient_clipping": 1.0, "zero_optimization": dict(zero)}
    if kind == "zerotrain":
        import zerotrain

        config.update(optimizer={"type": "AdamW", "params": {"lr": LR}}, comm_timeout_seconds=600)
        engine, _, _, _ = zerotrain.initialize(model=model, config=config)
        return engine, engine.close
    import deepspeed

    config.update(optimizer={"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}, steps_per_print=10 ** 9)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, engine.destroy


def _run_variant(name: str, args: dict, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    engine, close = _engine(name, args)
    batches = _batches(args, rank)
    times, losses = [], []
    local_first = int(os.environ["LOCAL_RANK"]) == 0
    for index, (x, y) in enumerate(batches):
        if index == args["warmup"]:
            dist.barrier()
            tx_start = _link_tx() if local_first else 0
        dist.barrier()
        started = time.perf_counter()
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        if index >= args["warmup"]:
            times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    dist.barrier()
    tx = (_link_tx() - tx_start) if local_first else 0
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    close()
    return {"status": "ok", "times": times, "tx": tx, "loss": (mean / WORLD).tolist()}


def worker(spec: dict) -> int:
    """One rank: every variant in turn; the results to spec['out']."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    results: dict[str, Any] = {}
    for name in spec["variants"]:
        try:
            results[name] = _run_variant(name, spec["args"], rank)
        except Exception as error:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
            results[name] = {"status": "failed", "reason": f"{type(error).__name__}: {str(error).splitlines()[0]}",
                             "traceback": traceback.format_exc()}
            Path(spec["out"]).write_text(json.dumps(results))
            break  # the other ranks may be stuck in a collective of this variant: end the launch
        Path(spec["out"]).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed leaves threads behind that keep a plain exit waiting


def _set_rate(nodes: "netns.Nodes", rate: str) -> None:
    for node in nodes.nodes:
        if rate == "none":
            subprocess.run(["tc", "-n", node.netns, "qdisc", "del", "dev", netns.LINK, "root"], capture_output=True)
        else:  # a token bucket of ~4 ms of traffic (at least 256 KiB) so the kernel's timer does not cap the rate
            burst = max(256 * 1024, int(_bits(rate) / 8 / 250))
            subprocess.run(["tc", "-n", node.netns, "qdisc", "replace", "dev", netns.LINK, "root", "tbf", "rate",
                            rate, "burst", str(burst), "latency", "100ms"], check=True, capture_output=True)


def _bits(rate: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower()).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nodes: "netns.Nodes", variants: list[str], args: dict, workdir: Path, timeout: float) -> list[dict]:
    """4 ranks (2 per node) running `variants`; each rank's results."""
    port, procs, outs = _free_port(), [], []
    for rank in range(WORLD):
        node = nodes[rank // PER_NODE]
        out = workdir / f"rank{rank}.json"
        out.unlink(missing_ok=True)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                   LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(node.index), MASTER_ADDR=nodes[0].address,
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        spec = {"variants": variants, "args": args, "out": str(out)}
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(node.command([sys.executable, __file__, "--_worker", json.dumps(spec)]),
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
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


def merge(ranks: list[dict], name: str) -> dict:
    """One variant at one rate: the slowest rank per step, the link bytes per step (both nodes)."""
    mine = [r.get(name) for r in ranks]
    failed = [m for m in mine if m and m["status"] != "ok"]
    if failed or not all(mine):
        return {"status": "failed", "reason": failed[0]["reason"] if failed else "did not run (timeout or an earlier failure)"}
    steps = len(mine[0]["times"])
    slowest = [max(m["times"][i] for m in mine) for i in range(steps)]
    tx_nodes = [sum(m["tx"] for m in mine[n * PER_NODE:(n + 1) * PER_NODE]) / steps for n in range(WORLD // PER_NODE)]
    return {"status": "ok", "step_s": statistics.median(slowest), "link_bytes": sum(tx_nodes),
            "busiest_node_bytes": max(tx_nodes), "loss": mine[0]["loss"][-1]}


def render(table: dict, rates: list[str], variants: list[str], psi: int, args: dict, load: tuple) -> str:
    lines = [f"GPT {args['model']} ({psi // 4 / 1e6:.2f}M parameters, Psi = {psi / 1e6:.1f} MB fp32), 2 nodes x 2 ranks, "
             f"B*T per rank = {args['batch']}x{args['seq_len']}, {args['warmup']} warm-up + {args['steps']} timed steps; "
             f"tbf-shaped veth, no added latency (no netem); load average {load[0]:.1f} before, {load[1]:.1f} after",
             "",
             "| rate | variant | step s | / zt3 | model s | link MB/step | / zt3 | theory MB | final loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        base = table[rate].get("zt3", {})
        for name in variants:
            cell = table[rate][name]
            if cell["status"] != "ok":
                lines.append(f"| {rate} | {name} | {cell['reason'][:90]} | | | | | | |")
                continue
            bare = table.get("none", {}).get(name, {})
            model = "" if rate == "none" or bare.get("status") != "ok" else \
                f"{bare['step_s'] + cell['busiest_node_bytes'] * 8 / _bits(rate):.2f}"
            ratio = (lambda key: f"{cell[key] / base[key]:.2f}" if base.get("status") == "ok" and base[key] else "")
            lines.append(f"| {rate} | {name} | {cell['step_s']:.2f} | {ratio('step_s')} | {model} | "
                         f"{cell['link_bytes'] / 1e6:.1f} | {ratio('link_bytes')} | {THEORY[name] * psi / 1e6:.1f} | "
                         f"{cell['loss']:.4f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,1gbit,100mbit", help="tbf rates of the link, 'none': unshaped")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", default="small", help="zerotrain.models GPT preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch (one rate)")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--render", metavar="JSON", help="print the table of an earlier --json run; run nothing")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parsed = parser.parse_args(argv)
    if parsed._worker:
        return worker(json.loads(parsed._worker))
    if parsed.render:
        saved = json.loads(Path(parsed.render).read_text())
        table = saved["table"]
        print(render(table, list(table), list(next(iter(table.values()))), saved["psi"], saved["args"],
                     tuple(saved.get("load", (float("nan"), float("nan"))))))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`/kill: tear the nodes down on the way out
    if netns.skip_reason():
        print(f"cannot build two nodes here: {netns.skip_reason()}", file=sys.stderr)
        return 2
    rates, variants = parsed.rates.split(","), parsed.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    args = {k: getattr(parsed, k) for k in ("model", "batch", "seq_len", "steps", "warmup")}
    psi = 4 * sum(p.numel() for p in _model(args).parameters())
    load_before = os.getloadavg()[0]
    table: dict[str, dict] = {}
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerotrain-multinode-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    with netns.two_nodes(shm_size="1g") as nodes:
        for rate in rates:
            _set_rate(nodes, rate)
            started = time.monotonic()
            ranks = launch(nodes, variants, args, workdir, parsed.timeout)
            table[rate] = {name: merge(ranks, name) for name in variants}
            print(f"{rate}: {time.monotonic() - started:.0f} s; "
                  + ", ".join(f"{n} {c['step_s']:.2f} s" if c["status"] == "ok" else f"{n} {c['reason']}"
                              for n, c in table[rate].items()), flush=True)
    text = render(table, rates, variants, psi, args, (load_before, os.getloadavg()[0]))
    print(text)
    if parsed.json:
        Path(parsed.json).write_text(json.dumps({"args": args, "psi": psi, "table": table,
                                                 "load": (load_before, os.getloadavg()[0])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
