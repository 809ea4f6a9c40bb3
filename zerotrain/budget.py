"""The memory budget: the size keys a config leaves unset, chosen to fit the machine, and the refusal of
a run that cannot fit (issue #27; the rules are in docs/configuration.md, "Memory budget").

DeepSpeed's defaults are element counts picked for GPU hosts with hundreds of GB of RAM
(`reduce_bucket_size` 5e8, `offload_param.max_in_cpu` 1e9, `buffer_size` 1e8 ...): on a smaller host
they make memory grow with the model until the kernel's OOM killer ends the run. Here a key the user
leaves unset is sized from a per-rank budget instead:

- the budget: `zero_optimization.memory_budget_bytes` when set, else `DEFAULT_FRACTION` of the host
  memory available to the job (the smallest of /proc/meminfo's MemAvailable and the cgroup's
  `memory.max` - `memory.current` (v2) or `memory.limit_in_bytes` - `memory.usage_in_bytes` (v1)) split
  over the ranks on the node, plus what this rank already holds; the minimum over the ZeRO ranks, so
  that every rank chooses the same sizes (sizes that differ would mismatch the collectives);
- what the runtime (the rank's resident bytes besides the model's tensors) and the model states need on
  the host (`estimate.estimate_option` with every sized key at its smallest) is taken off, and what is left (the headroom) is shared out by `SHARES`; each size is kept
  between its smallest useful value and DeepSpeed's default;
- a key the user sets wins; the resolved run (the estimate with the chosen sizes) is then compared with
  the memory there is (the set budget, or else the whole available share of the rank): a run that cannot
  fit is refused before any step, naming its largest consumers and the keys that shrink them.

The norm's first pass (NVMe offload with clipping, `offload.nvme.takes_norm_first`) keeps every activation of the
micro-batch alive through a whole backward, on top of that backward's buffers (a plain backward frees them as it
goes: issue #43 measured the first pass 0.25-0.33 GiB over the spill at 4B). They depend on the batch, unknown
when the sizes are chosen, so on a CPU run (where activations are host memory) `FirstPassReserve` takes them out
of the parameter store's host cache once the forward has counted them: the one consumer a key sizes that can
shrink between steps (an evicted shard is read from its file again); a `max_in_cpu` the user sets is kept.

`plan_sizes` and `check_fits` are pure functions of their arguments (tests call them directly);
`resolve_memory` is what the engine calls (however it is built: `initialize` or `ZeroTrainEngine(...)`): it
measures, agrees, plans, prints (`announce`: rank 0, on stderr, one line per choice, once per process) and
returns the config with the chosen values. `estimate_sizes` applies the same rules for `zerotrain estimate`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .comm import Comm
from .config import ConfigError
from .estimate import ModelShape, RankMemory, config_option, estimate_option, format_bytes, model_shape, \
    probe_optimizer
from .topology import Topology
from .zero.interfaces import ParamStore

__all__ = ["DEFAULT_FRACTION", "SHARES", "HostMemory", "Choice", "MemoryPlan", "host_memory_available",
           "default_budget", "runtime_bytes", "plan_sizes", "check_fits", "shrink_advice", "resolve_memory", "announce",
           "estimate_sizes", "FirstPassReserve", "first_pass_reserve"]

# The share of the host memory available to the job that the budget takes by default: the rest is left to
# the activations (not known before the first batch), the allocator's caching and the runtime.
DEFAULT_FRACTION = 0.5

# How the headroom (budget - runtime - model states) is shared out among the consumers a key sizes. They add up
# to 80%: the rest is for what the estimate does not model (allocator caching, reads ahead, the step thread's
# queue; benchmarks/RESULTS_scale.md measured peak RSS at 1.1-1.2x the estimate plus the runtime).
SHARES = {
    "reduce_bucket_size": 0.12,       # gradient staging: 2 buckets in the training dtype
    "stage3_max_live_parameters": 0.12,  # gathered parameters (stage 3)
    "offload_param.max_in_cpu": 0.24,    # the NVMe parameter store's host cache
    "offload_param.buffer_size": 0.16,   # the NVMe parameter store's write buffers (buffer_count of them)
    "offload_optimizer.buffer_count": 0.16,  # the NVMe optimizer's record buffers
}

# The smallest useful value of each element count (below it a key costs more in calls than it saves).
MIN_BUCKET = 1 << 20           # 1M elements: a reduce bucket
MIN_WRITE_BUFFER = 1 << 20     # 1M elements: one write buffer of the parameter store
DEEPSPEED = {"reduce_bucket_size": 500_000_000, "stage3_max_live_parameters": 1_000_000_000,
             "offload_param.max_in_cpu": 1_000_000_000, "offload_param.buffer_size": 100_000_000,
             "offload_param.buffer_count": 5, "offload_optimizer.buffer_count": 4}

PREFIX = "zero_optimization."


@dataclass(frozen=True)
class HostMemory:
    """Host memory this job may still use (bytes) and where the number comes from."""
    available: int
    source: str


@dataclass(frozen=True)
class Choice:
    """One size key: its value and why (`user` True: the config set it)."""
    key: str
    value: int
    reason: str
    user: bool = False


@dataclass
class MemoryPlan:
    """The budget, what the model states take of it, and the size chosen for each key."""
    budget: int
    budget_reason: str
    states: int
    choices: list[Choice] = field(default_factory=list)

    def value(self, key: str) -> Optional[int]:
        return next((c.value for c in self.choices if c.key == key), None)

    def lines(self) -> list[str]:
        """What rank 0 prints at start: the budget, then one line per choice."""
        head = (f"zerotrain memory budget: {format_bytes(self.budget)} per rank ({self.budget_reason}); the "
                f"runtime, model states and smallest step buffers {format_bytes(self.states)}, headroom "
                f"{format_bytes(max(0, self.budget - self.states))}")
        return [head] + [f"  {PREFIX}{c.key} = {c.value:,}: {c.reason}" for c in self.choices]

    def apply(self, config):
        """`config` with the chosen values of the keys it left unset (the set of keys the user gave is kept,
        so a later reader still tells them apart)."""
        zero = config.zero_optimization
        top, nested = {}, {"offload_param": {}, "offload_optimizer": {}}
        for choice in self.choices:
            if choice.user:
                continue
            block, _, name = choice.key.rpartition(".")
            (nested[block] if block else top)[name] = choice.value
        for block, values in nested.items():
            if values:
                top[block] = _with_values(getattr(zero, block), values)
        return _with_values(config, {"zero_optimization": _with_values(zero, top)}) if top else config


def _with_values(block, values: dict):
    """A copy of the pydantic block with `values`, its fields-set (what the user gave) unchanged."""
    copy = block.model_copy(update=values)
    object.__setattr__(copy, "__pydantic_fields_set__", set(block.model_fields_set))
    return copy


# --- how much memory there is ------------------------------------------------------------------------
def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as handle:
            text = handle.read().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _cgroup_dirs(root: str) -> tuple[Optional[str], Optional[str]]:
    """(v2 directory, v1 memory-controller directory) of this process's cgroup under `root`."""
    v2 = v1 = None
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as handle:
            for line in handle:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and controllers == "":
                    v2 = os.path.join(root, "sys/fs/cgroup", path.lstrip("/"))
                elif "memory" in controllers.split(","):
                    v1 = os.path.join(root, "sys/fs/cgroup/memory", path.lstrip("/"))
    except OSError:
        pass
    return v2, v1


def host_memory_available(root: str = "/") -> HostMemory:
    """The host memory this job may still use: the least of MemAvailable and the cgroup's limit less its
    usage (v2: memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes), so that a
    container's limit counts, not only the machine's free memory. `root`: where /proc and /sys are (tests)."""
    found: list[tuple[int, str]] = []
    try:
        with open(os.path.join(root, "proc/meminfo")) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    v2, v1 = _cgroup_dirs(root)
    for directory, limit_file, usage_file, label in ((v2, "memory.max", "memory.current", "cgroup v2 memory.max"),
                                                      (v1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                       "cgroup v1 memory.limit_in_bytes")):
        if directory is None:
            continue
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file)) or 0
        if limit is not None and limit < (1 << 60):  # v1 writes "no limit" as a huge number
            found.append((max(0, limit - usage), f"{label} less usage"))
    if not found:
        return HostMemory(0, "unknown")
    available, source = min(found)
    return HostMemory(available, source)


def _own_rss(root: str = "/") -> int:
    """This process's resident bytes (already part of what it may use)."""
    try:
        with open(os.path.join(root, "proc/self/statm")) as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def runtime_bytes(model: torch.nn.Module, own: int) -> int:
    """What this rank holds besides the model's tensors (`own`: its resident bytes now, less the host bytes of
    the model's parameters and buffers, which the estimate counts itself)."""
    seen, held = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    return max(0, own - held)


def ranks_on_node(topology: Topology) -> int:
    """How many ranks of this job share this rank's host (each takes a part of its memory)."""
    return int(topology.ranks_per_node or topology.dp_size) * topology.tp_size


def load_copy_allowance(topology: Topology, host: Optional[HostMemory] = None) -> int:
    """Host bytes one rank may spend, now, on a checkpoint load's second copy of its optimizer states (read
    into new tensors and swapped in after the verdict: one pass over the bytes instead of a checksum pass and
    a copy): `DEFAULT_FRACTION` of its share of the host memory available, the rule of the default budget."""
    host = host or host_memory_available()
    return default_budget(host.available, ranks_on_node(topology))


def default_budget(available: int, ranks_on_node: int, own: int = 0, fraction: float = DEFAULT_FRACTION) -> int:
    """`fraction` of this rank's part of the available host memory (its share of `available` plus the
    `own` bytes it already holds)."""
    return int(fraction * (available // max(1, ranks_on_node) + own))


# --- the sizes ----------------------------------------------------------------------------------------
def _zero_keys(config, device_type: str) -> dict[str, tuple[object, str]]:
    """The host-memory size keys this config's run uses: key -> (block, field name). On a GPU the reduce buckets
    and the gathered parameters are device memory, which this budget does not cover: they keep their values."""
    zero = config.zero_optimization
    on_host = device_type == "cpu"
    # at stages 0-1 every rank holds the whole gradient buffer whatever the bucket size: no key to size
    keys = {"reduce_bucket_size": (zero, "reduce_bucket_size")} if zero.stage >= 2 and on_host else {}
    if zero.stage == 3:
        if on_host:
            keys["stage3_max_live_parameters"] = (zero, "stage3_max_live_parameters")
        offload = zero.offload_param
        if offload is not None and offload.device == "nvme":
            for name in ("max_in_cpu", "buffer_count", "buffer_size"):
                keys[f"offload_param.{name}"] = (offload, name)
    opt = zero.offload_optimizer
    if opt is not None and opt.device == "nvme" and zero.stage >= 1:
        keys["offload_optimizer.buffer_count"] = (opt, "buffer_count")
    return keys


def _modules(shape: ModelShape, dp_size: int, threshold: int) -> tuple[int, int, int]:
    """(largest parameter, two largest modules, largest shard) in elements of the non-persistent parameters."""
    per_module: dict[str, int] = {}
    largest = shard = 0
    for p in shape.params:
        if p.numel <= threshold:
            continue
        padded = -(-p.numel // dp_size) * dp_size
        largest, shard = max(largest, padded), max(shard, padded // dp_size)
        module = p.name.rpartition(".")[0]
        per_module[module] = per_module.get(module, 0) + padded
    return largest, sum(sorted(per_module.values())[-2:]), shard


def _host_bytes(memory: RankMemory, device_type: str) -> int:
    """What a rank holds in host memory at the peak of a step (on a CPU run the device is the host)."""
    total = memory.total("host")
    if device_type == "cpu":
        total += memory.total("device") + sum(memory.transient.values())
    return total


def plan_sizes(budget: int, shape: ModelShape, dp_size: int, config, device_type: str = "cpu",
               budget_reason: str = "given", optimizer=None, runtime: int = 0) -> MemoryPlan:
    """The value of every size key of `config`'s run at `dp_size` ZeRO ranks for a per-rank `budget` (bytes).

    The keys the config set keep their values. The others share the headroom left after the model states
    (`SHARES`), each between its smallest useful value and DeepSpeed's default:
    reduce_bucket_size = share / (2 x dtype bytes) (the bucket being filled and one in flight);
    stage3_max_live_parameters = share / dtype bytes, at least the two largest modules (what a forward holds);
    offload_param.max_in_cpu = share / dtype bytes; offload_param.buffer_size = share / (buffer_count x dtype
    bytes), at most the largest shard (no buffer larger than what it writes); offload_param.buffer_count =
    DeepSpeed's 5, fewer if even 1M-element buffers do not fit; offload_optimizer.buffer_count = share / one
    record buffer, 2 to 4. `runtime`: host bytes the rank holds that the estimate does not count (Python,
    torch, the communication library), taken off the budget with the model states."""
    from .precision import training_dtype

    zero = config.zero_optimization
    d = training_dtype(config.precision).itemsize
    keys = _zero_keys(config, device_type)
    user = {key for key, (block, name) in keys.items() if name in block.model_fields_set}
    optimizer = optimizer or probe_optimizer(config.optimizer)
    threshold = int(zero.stage3_param_persistence_threshold) if zero.stage == 3 else -1
    largest, two_modules, largest_shard = _modules(shape, dp_size, threshold)
    # the floor: every unset key at its smallest; what that run needs is the model states
    smallest = {"reduce_bucket_size": MIN_BUCKET, "stage3_max_live_parameters": max(1, two_modules),
                "offload_param.max_in_cpu": 0, "offload_param.buffer_count": 1,
                "offload_param.buffer_size": max(1, min(MIN_WRITE_BUFFER, largest_shard)),
                "offload_optimizer.buffer_count": 2}
    floor = MemoryPlan(budget, budget_reason, 0, [Choice(k, smallest[k], "") for k in keys if k not in user])
    states = runtime + _host_bytes(estimate_option(shape, floor.apply(config), dp_size, config_option(config),
                                                   optimizer, device_type), device_type)
    headroom = max(0, budget - states)
    plan = MemoryPlan(budget, budget_reason, states)

    def pick(key: str, wanted: float, low: int, high: int, unit: str, cap: str = "DeepSpeed's default") -> None:
        block, name = keys[key]
        if key in user:
            plan.choices.append(Choice(key, int(getattr(block, name)), "set in the config", user=True))
            return
        value = int(max(low, min(high, wanted)))
        why = (f"{SHARES.get(key, 0):.0%} of the headroom = {unit}" if low < wanted < high
               else f"{cap} (the headroom allows more)" if wanted >= high
               else f"the smallest useful value (the headroom allows {int(max(0, wanted)):,})")
        plan.choices.append(Choice(key, value, why))

    share = lambda key: SHARES[key] * headroom  # noqa: E731 - bytes of one consumer's share
    if "reduce_bucket_size" in keys:
        # Stage 3: at most the largest parameter. A bucket holds its members' whole (unsharded) gradients until
        # its reduce-scatter; one as large as the model held them all at the end of backward, above FSDP2,
        # which reduces one block at a time (benchmarks/RESULTS_zero_speed.md, the untied-head shape). A rank
        # holds the largest parameter's whole gradient anyway, and a bucket of it alone needs no copy.
        cap, why = ((min(DEEPSPEED["reduce_bucket_size"], max(MIN_BUCKET, largest)), "the largest parameter")
                    if zero.stage == 3 and largest else (DEEPSPEED["reduce_bucket_size"], "DeepSpeed's default"))
        pick("reduce_bucket_size", share("reduce_bucket_size") / (2 * d), MIN_BUCKET, cap,
             "2 buckets in the training dtype", why)
    if "stage3_max_live_parameters" in keys:
        pick("stage3_max_live_parameters", share("stage3_max_live_parameters") / d, max(1, two_modules),
             max(two_modules, DEEPSPEED["stage3_max_live_parameters"]),
             "gathered elements (at least the two largest modules)")
    if "offload_param.max_in_cpu" in keys:
        pick("offload_param.max_in_cpu", share("offload_param.max_in_cpu") / d, 0,
             DEEPSPEED["offload_param.max_in_cpu"], "cached shard elements")
        pool = share("offload_param.buffer_size") / d  # elements of all write buffers together
        pick("offload_param.buffer_count", DEEPSPEED["offload_param.buffer_count"] if pool >=
             DEEPSPEED["offload_param.buffer_count"] * MIN_WRITE_BUFFER else pool / MIN_WRITE_BUFFER, 1,
             DEEPSPEED["offload_param.buffer_count"], "write buffers")
        count = plan.value("offload_param.buffer_count")
        pick("offload_param.buffer_size", pool / count, min(MIN_WRITE_BUFFER, max(1, largest_shard)),
             max(1, min(DEEPSPEED["offload_param.buffer_size"], largest_shard)),
             f"elements per write buffer ({count} of them; a larger shard is written in pieces)",
             "the largest shard, or DeepSpeed's default if less")
    if "offload_optimizer.buffer_count" in keys:
        from .offload.nvme import DEFAULT_CHUNK_NUMEL
        narrow = config.bf16_records  # bf16 master (and states): offload.nvme.record_dtypes
        stored = 2 + optimizer.per_element // (2 if config.bf16.bf16_optimizer_states else 1) if narrow \
            else 4 + optimizer.per_element
        record = DEFAULT_CHUNK_NUMEL * (stored + 4)  # a chunk's record and its gradient region
        pick("offload_optimizer.buffer_count", share("offload_optimizer.buffer_count") / record, 2,
             DEEPSPEED["offload_optimizer.buffer_count"], f"record buffers of {format_bytes(record)}")
    return plan


# --- refusing a run that cannot fit -------------------------------------------------------------------
# The keys that shrink each consumer (estimate rows and transients).
SHRINK = {
    "parameters": "zero_optimization.stage: 3, offload_param.device, offload_param.max_in_cpu",
    "gradients": "zero_optimization.stage: 2 or 3, offload_optimizer.device; with gradient_clipping > 0 every "
                 "gradient shard waits for the norm in memory unless stage 3 with offload_optimizer.device: nvme "
                 "spills them to disk (gradient_accumulation_steps 1, no fp16), or gradient_clipping: 0",
    "master_weights": "zero_optimization.offload_optimizer.device: nvme",
    "optimizer_states": "zero_optimization.offload_optimizer.device: nvme",
    "host_io_buffers": "offload_param.buffer_count / buffer_size, offload_optimizer.buffer_count",
    "buffers": "the model's own buffers",
    "runtime": "Python, torch and the communication library",
    "loco_errors": "zeropp_loco_param",
    "gathered parameters (bound)": "stage3_max_live_parameters",
    "gradient staging": "reduce_bucket_size",
    "whole gradient of the largest parameter": "the model's largest parameter",
}


def shrink_advice(name: str, config=None) -> str:
    """The way out for consumer `name` (an estimate row or transient) in the run of `config`: `SHRINK`'s keys,
    and for the optimizer's rows (masters, states, gradients) what fits the run's offload_optimizer device: on
    the CPU (or none) moving them to NVMe or bf16 masters and states; on NVMe the part kept in host memory
    (`ratio` < 1). Without a config, `SHRINK`'s line."""
    advice = SHRINK.get(name, "-")
    if config is None or name not in ("master_weights", "optimizer_states", "gradients"):
        return advice
    zero = config.zero_optimization
    offload = zero.offload_optimizer
    device = offload.device if offload is not None else "none"
    key = "zero_optimization.offload_optimizer"
    where = f"{key}.device {device}" if device != "none" else f"no {key}"
    if name == "gradients":
        if device == "nvme" or not config.gradient_clipping:
            return advice
        return (f"with {where} and gradient_clipping > 0 every gradient shard waits for the norm in host memory: "
                f"{key}.device nvme at stage 3 spills them to disk (gradient_accumulation_steps 1, no fp16), or "
                f"gradient_clipping: 0")
    if device == "nvme":
        return f"{key}.ratio: 1.0 (the part kept in host memory; {float(offload.ratio):g} now)"
    narrow = ""
    if config.bf16.enabled and not config.bf16.bf16_optimizer_states and \
            (device == "cpu" and not offload.super_offload):
        narrow = (" or bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states (bf16 masters and states: "
                  "half the bytes)")
    return f"host memory with {where}: {key}.device nvme puts them on disk{narrow}"


def _consumers(memory: RankMemory, device_type: str) -> list[tuple[str, int]]:
    places = ("host", "device") if device_type == "cpu" else ("host",)
    rows = [(row, sum(memory.rows[row][p] for p in places)) for row in memory.rows]
    if device_type == "cpu":
        rows += list(memory.transient.items())
    return sorted(((name, nbytes) for name, nbytes in rows if nbytes > 0), key=lambda item: -item[1])


def check_fits(memory: RankMemory, limit: int, limit_reason: str, device_type: str = "cpu",
               device_limit: Optional[int] = None, runtime: int = 0, share: Optional[int] = None,
               config=None) -> None:
    """Raise a one-line ConfigError when the estimated bytes per rank (`memory`: the resolved run) exceed
    `limit` (host bytes per rank: the printed budget; on a CPU run the device is the host) or, on a GPU,
    `device_limit`; it names the numbers, the three largest consumers and the keys that shrink them. `runtime`:
    host bytes besides the model's tensors (counted with the host's). `share`: the host memory this rank may
    use when `limit` is the default budget (a part of it): the message says a larger `memory_budget_bytes`
    up to it is a way out too. `config`: the run's, so that the advice fits its offload device (`shrink_advice`);
    consumers with the same advice name it once."""
    checks = [("host", runtime + _host_bytes(memory, device_type), limit, limit_reason)]
    if device_type != "cpu" and device_limit is not None:
        device = memory.total("device") + sum(memory.transient.values())
        checks.append(("device", device, device_limit, "free device memory"))
    for place, need, have, why in checks:
        if have <= 0 or need <= have:
            continue
        if place == "host":
            top = sorted(_consumers(memory, device_type) + [("runtime", runtime)], key=lambda item: -item[1])[:3]
        else:
            top = sorted([(r, memory.rows[r]["device"]) for r in memory.rows] + list(memory.transient.items()),
                         key=lambda item: -item[1])[:3]
        advice = [shrink_advice(name, config) for name, _ in top]
        named = "; ".join(f"{name} {format_bytes(nbytes)} ({'the same' if text in advice[:i] else text})"
                          for i, ((name, nbytes), text) in enumerate(zip(top, advice)))
        raise_budget = ""
        if place == "host" and share is not None and need <= share:
            raise_budget = (f"; or set zero_optimization.memory_budget_bytes up to {share:,} (this rank's share of "
                            f"the available memory, {format_bytes(share)}: the default budget is "
                            f"{DEFAULT_FRACTION:.0%} of it, the rest for activations and caching)")
        raise ConfigError(f"zero_optimization: this run needs {format_bytes(need)} of {place} memory per rank "
                          f"(zerotrain estimate, activations not counted), more than the {format_bytes(have)} "
                          f"there are ({why}); largest: {named}{raise_budget}", key="zero_optimization")


# --- what the engine calls ----------------------------------------------------------------------------
_announced = [False]  # whether this process printed a plan already


def announce(plan: MemoryPlan, rank: int) -> bool:
    """Print the plan's lines on stderr (a script's own output stays its own), once per process, on rank 0, and
    only when the budget chose something (every size key set: nothing to say). Later engines of the same process
    (a test suite, an evaluation engine beside the training one) print nothing: their choices follow the same
    rules, and `zerotrain estimate` shows them for any config. Returns whether it printed."""
    if rank != 0 or _announced[0] or all(choice.user for choice in plan.choices):
        return False
    _announced[0] = True
    print("\n".join(plan.lines()), file=sys.stderr, flush=True)
    return True



def estimate_sizes(shape: ModelShape, config, zero_ranks: int, device_type: str, optimizer=None,
                   ranks_on_node: Optional[int] = None, host: Optional[HostMemory] = None):
    """`zerotrain estimate`'s view of the budget: `config` with its unset size keys as a run of `zero_ranks` ranks
    (`ranks_on_node` of them on one node) would choose them, and the plan (its `lines()`). The budget is the
    config's `memory_budget_bytes`, else `DEFAULT_FRACTION` of the host memory available on this machine now
    (`host`) over the ranks on the node; the runtime (unknown before a run) is not taken off."""
    zero = config.zero_optimization
    host = host or host_memory_available()
    ranks = max(1, int(ranks_on_node or zero_ranks))
    explicit = zero.memory_budget_bytes
    budget = int(explicit) if explicit is not None else default_budget(host.available, ranks)
    reason = (f"{PREFIX}memory_budget_bytes" if explicit is not None else
              f"{DEFAULT_FRACTION:.0%} of this machine's {host.source} {format_bytes(host.available)} / {ranks} "
              f"ranks on the node")
    plan = plan_sizes(budget, shape, zero_ranks, config, device_type, reason, optimizer)
    return plan.apply(config), plan


def resolve_memory(model: torch.nn.Module, config, topology: Topology, comm: Optional[Comm] = None,
                   host: Optional[HostMemory] = None, trains: bool = True):
    """`config` with its unset size keys chosen from the memory budget (agreed over the ZeRO ranks), after
    checking that the run fits; rank 0 prints the choices. Collective over the ZeRO group. `trains` False: a
    forward-only engine (no gradients, masters or optimizer states to count)."""
    comm = comm or Comm.data_parallel(topology)
    zero = config.zero_optimization
    device_type = topology.device.type
    host = host or host_memory_available()
    ranks = ranks_on_node(topology)
    own = _own_rss()
    share = host.available // ranks + own  # this rank's part of what the job may use
    explicit = zero.memory_budget_bytes
    budget = int(explicit) if explicit is not None else default_budget(host.available, ranks, own)
    # one budget, share and runtime (the largest) for every rank: the sizes and the check below follow from them
    # and the model, the same everywhere (ranks that chose differently would mismatch their collectives)
    budget, share, negative_runtime = comm.min_ints([budget, share, -runtime_bytes(model, own)], topology.device)
    runtime = -negative_runtime
    reason = (f"{PREFIX}memory_budget_bytes" if explicit is not None else
              f"{DEFAULT_FRACTION:.0%} of {format_bytes(share)}: {host.source} / {ranks} ranks on the node "
              f"+ this rank's {format_bytes(own)}, least over {comm.size} ranks")
    shape = model_shape(model)
    if not trains:
        shape = replace(shape, params=[replace(p, trainable=False) for p in shape.params])
    optimizer = probe_optimizer(config.optimizer)
    plan = plan_sizes(budget, shape, comm.size, config, device_type, reason, optimizer, runtime)
    resolved = plan.apply(config)
    announce(plan, topology.rank)
    memory = estimate_option(shape, resolved, comm.size, config_option(resolved), optimizer, device_type)
    # the limit is the budget printed above, not the whole share it is a part of: a run the smallest sizes
    # cannot bring under it is refused here, before any step (issue #43: "headroom 0", then 2x the budget)
    limit, why = ((budget, f"{PREFIX}memory_budget_bytes") if explicit is not None
                  else (budget, f"the memory budget printed: {reason}"))
    device_limit = None
    if device_type == "cuda":  # free device memory plus what this process already holds (the model, counted)
        free = torch.cuda.mem_get_info(topology.device)[0] + torch.cuda.memory_reserved(topology.device)
        device_limit = comm.min_ints([free], topology.device)[0]
    check_fits(memory, limit, why, device_type, device_limit, runtime, share=None if explicit is not None else share,
               config=resolved)
    return resolved


# --- the norm's first pass: its activations out of the parameter cache ----------------------------------
class FirstPassReserve:
    """Holds the largest micro-batch's saved activations back from the parameter store's host cache (see the
    module docstring); rank 0 says so once, on stderr, as the plan's lines."""

    def __init__(self, store: ParamStore, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.held = 0  # bytes held back: the largest activations counted so far

    def hold(self, activation_bytes: int) -> None:
        """Before a first pass: `activation_bytes` (what the micro-step's forwards saved) held back from the
        cache where they are more than any micro-batch's before."""
        if activation_bytes <= self.held:
            return
        first = self.held == 0
        self.held = int(activation_bytes)
        bound = self.store.hold_back_cache(self.held)
        if first and self.rank == 0:
            print(f"zerotrain memory budget: the clip's first backward keeps this micro-batch's activations "
                  f"({format_bytes(self.held)}, counted in its forward) alive on top of the backward's buffers; the "
                  f"parameter cache gives them up: {PREFIX}offload_param.max_in_cpu holds "
                  f"{format_bytes(bound)} from now on (less if a later micro-batch keeps more)",
                  file=sys.stderr)  # (stderr is line-buffered)


def first_pass_reserve(config, store: Optional[ParamStore], takes_first_pass: bool,
                       topology: Topology) -> Optional[FirstPassReserve]:
    """The reserve for an engine whose steps take the norm from a first pass (`takes_first_pass`), on a CPU run
    (on an accelerator the activations are in device memory, which the estimate counts with the backward's
    buffers), with its parameters on NVMe in a store whose cache bound the budget chose (`max_in_cpu` unset);
    else None."""
    if (not takes_first_pass or store is None or store.kind != "nvme" or topology.device.type != "cpu"
            or "max_in_cpu" in config.zero_optimization.offload_param.model_fields_set):  # (a store: the block)
        return None
    return FirstPassReserve(store, topology.rank)
