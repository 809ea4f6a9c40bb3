"""Ranks from the launcher a cluster already has: MPI (Open MPI, MPICH / Intel MPI's PMI) or Slurm's `srun`.

zerotrain's process group starts from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). A process started by `mpirun` or `srun` has its launcher's instead. :func:`adopt_cluster_ranks`
maps them onto torchrun's names when RANK and WORLD_SIZE are unset (as DeepSpeed's ``mpi_discovery`` does for
MPI, without mpi4py), so `mpirun -n 4 python train.py` and `srun python train.py` start the same job as
`zerotrain launch`. Variables already set are never overwritten. `topology.init_distributed` and
`zerotrain.initialize` call it (idempotent).

- Open MPI: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE.
- MPICH, Intel MPI (Hydra), MVAPICH: PMIX_RANK or PMI_RANK (both set: they must agree, as DeepSpeed's
  launcher_helper checks), PMI_SIZE (else WORLD_SIZE, which DeepSpeed's MPICH line exports), PALS_LOCAL_RANKID or
  MPI_LOCALRANKID; the ranks per host from MPI_LOCALNRANKS, PALS_LOCAL_SIZE or DeepSpeed's LOCAL_SIZE.
- Slurm: SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID; the ranks per node from
  SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (``2(x3),1``) at SLURM_NODEID; MASTER_ADDR the first host of
  SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (``node[01-03,07]``, expanded by :func:`expand_nodelist`, as
  ``scontrol show hostnames`` does).

MASTER_PORT defaults to 29500 (torch's and DeepSpeed's default). An MPI job whose ranks span several hosts needs
MASTER_ADDR from its launcher (``mpirun -x MASTER_ADDR=node0``): without mpi4py nothing else names rank 0's host;
one host uses 127.0.0.1.
"""
from __future__ import annotations

import os
import re
from typing import MutableMapping, Optional

__all__ = ["adopt_cluster_ranks", "expand_nodelist", "ClusterEnvError", "DEFAULT_MASTER_PORT"]

DEFAULT_MASTER_PORT = 29500


class ClusterEnvError(ValueError):
    """A cluster launcher's variables that cannot make a rendezvous (named in the message)."""


def _int(env: MutableMapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ClusterEnvError(f"environment variable {name} must be an integer, got {value!r}") from None


def _agreed(env: MutableMapping[str, str], launcher: str, names: tuple[str, ...], what: str) -> int:
    """The one value the set variables of `names` give (DeepSpeed's launcher_helper: PMIX_RANK before PMI_RANK,
    PALS_LOCAL_RANKID before MPI_LOCALRANKID), or one line naming the two that disagree."""
    given = [(name, _int(env, name)) for name in names if name in env]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise ClusterEnvError(f"{launcher}: the {what} of {given[0][0]}={given[0][1]} and {name}={value} "
                                  "disagree")
    return given[0][1]


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list as ``scontrol show hostnames`` expands it: ``node[01-03,07],gpu5`` ->
    node01 node02 node03 node07 gpu5 (zero padding kept; several bracket groups in one name multiply)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ClusterEnvError(f"bad Slurm node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ClusterEnvError(f"bad Slurm node list {text!r}: unbalanced '['")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ClusterEnvError(f"bad Slurm node list range {part!r} in {name!r}")
        width = len(low)
        for number in range(int(low), int(high if sep else low) + 1):
            out.extend(_expand_one(f"{head}{number:0{width}d}{tail}"))
    return out


def _tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """SLURM_TASKS_PER_NODE's count for node `node_id`: ``2(x3),1`` is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def _discover(env: MutableMapping[str, str]) -> Optional[tuple[str, dict[str, str]]]:
    """(launcher, torchrun's variables) from MPI's or Slurm's, or None when neither launched this process."""
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        found = {"RANK": _int(env, "OMPI_COMM_WORLD_RANK"), "WORLD_SIZE": _int(env, "OMPI_COMM_WORLD_SIZE")}
        for ours, theirs in (("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
                             ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
            if theirs in env:
                found[ours] = _int(env, theirs)
        launcher = "Open MPI (OMPI_COMM_WORLD_*)"
    elif ("PMIX_RANK" in env or "PMI_RANK" in env) and ("PMI_SIZE" in env or "WORLD_SIZE" in env):
        launcher = "MPI (PMI_RANK/PMI_SIZE)"
        found = {"RANK": _agreed(env, launcher, ("PMIX_RANK", "PMI_RANK"), "rank"),
                 "WORLD_SIZE": _int(env, "PMI_SIZE" if "PMI_SIZE" in env else "WORLD_SIZE")}
        if "PALS_LOCAL_RANKID" in env or "MPI_LOCALRANKID" in env:
            found["LOCAL_RANK"] = _agreed(env, launcher, ("PALS_LOCAL_RANKID", "MPI_LOCALRANKID"), "local rank")
        for theirs in ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "LOCAL_SIZE"):  # LOCAL_SIZE: DeepSpeed's -genv
            if theirs in env:
                found["LOCAL_WORLD_SIZE"] = _int(env, theirs)
                break
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        found = {"RANK": _int(env, "SLURM_PROCID"), "WORLD_SIZE": _int(env, size_var)}
        if "SLURM_LOCALID" in env:
            found["LOCAL_RANK"] = _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node and "SLURM_NODEID" in env:
            local = _tasks_on_node(per_node, _int(env, "SLURM_NODEID"))
            if local is not None:
                found["LOCAL_WORLD_SIZE"] = local
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist and "MASTER_ADDR" not in env:
            hosts = expand_nodelist(nodelist)
            if hosts:
                found["MASTER_ADDR"] = hosts[0]
        launcher = "Slurm (SLURM_PROCID)"
    else:
        return None
    if not 0 <= found["RANK"] < found["WORLD_SIZE"]:
        raise ClusterEnvError(f"{launcher}: rank {found['RANK']} is not below the world size {found['WORLD_SIZE']}")
    if "LOCAL_RANK" not in found:  # a LOCAL_RANK the launcher line exported (Intel MPI's -env) is kept
        found["LOCAL_RANK"] = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0 if found["WORLD_SIZE"] == 1 else -1
    if found["LOCAL_RANK"] < 0:
        raise ClusterEnvError(f"{launcher} gives no local rank (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or "
                              "SLURM_LOCALID); export LOCAL_RANK")
    one_host = found.get("LOCAL_WORLD_SIZE") == found["WORLD_SIZE"]
    if "MASTER_ADDR" not in env and "MASTER_ADDR" not in found:
        if not one_host:
            raise ClusterEnvError(f"{launcher}: MASTER_ADDR is unset and the ranks may span several hosts; export "
                                  "MASTER_ADDR=<rank 0's host> to every rank (mpirun -x MASTER_ADDR=...)")
        found["MASTER_ADDR"] = "127.0.0.1"
    return launcher, {name: str(value) for name, value in found.items()}


def adopt_cluster_ranks(env: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in `env`
    (os.environ by default) from MPI's or Slurm's variables when RANK or WORLD_SIZE is unset; variables already
    set are kept. Returns which launcher's variables were read, or None (a torchrun worker, or no launcher)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        if "LOCAL_WORLD_SIZE" not in env and "LOCAL_SIZE" in env:  # DeepSpeed's Intel MPI line: RANK and
            env["LOCAL_WORLD_SIZE"] = str(_int(env, "LOCAL_SIZE"))  # LOCAL_RANK per rank, LOCAL_SIZE for all
        return None
    discovered = _discover(env)
    if discovered is None:
        return None
    launcher, found = discovered
    found.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    for name, value in found.items():
        if name in ("RANK", "WORLD_SIZE") or name not in env:
            env[name] = value
    return launcher
