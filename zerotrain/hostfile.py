"""DeepSpeed's launcher resources for `zerotrain launch`: the hostfile, `--include`/`--exclude`, the
`--num_nodes`/`--num_gpus` caps, `--launcher` names and `.deepspeed_env`, with DeepSpeed 0.19's meaning
(`deepspeed/launcher/runner.py`; tests/test_hostfile.py compares every result with its functions).

- Hostfile lines ``HOST slots=N`` (anything after the count is ignored, as DeepSpeed's pattern does); ``#``
  comments and blank lines skipped; a bad line, a host listed twice or no host at all is one error naming the
  file and line.
- ``--include``/``--exclude``: ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = HOST[:SLOT[,SLOT ...]]``; the
  two exclude each other and the caps; the result keeps the hostfile's host order (ranks are numbered in it).
- ``--num_nodes N``: the first N hosts; ``--num_gpus G``: slots 0..G-1 on every host (as DeepSpeed, not capped
  by the hostfile's count).
- Without a hostfile the pool is this machine: ``localhost`` with a slot per GPU (per ``--nproc`` on CPU).
- ``.deepspeed_env`` (the name ``$DS_ENV_FILE`` overrides) in the home directory, then in the current one, a
  ``NAME=VALUE`` a line: forwarded to every host of a multi-host start (the later file wins a name).
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Optional

from .command import CLIError

__all__ = ["LAUNCHERS", "parse_hostfile", "select_resources", "read_deepspeed_env", "is_this_host",
           "local_slots"]

# DeepSpeed's --launcher names (case-insensitive there too); pdsh is its default
LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich")
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's pattern (runner._parse_hostfile)


def parse_hostfile(path: str) -> dict[str, int]:
    """Host -> slot count of an MPI-style hostfile, in file order."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CLIError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.search(line)
        if match is None:
            raise CLIError(f"{path}:{number}: bad hostfile line {line!r}: expected 'HOST slots=N'")
        host = match.group(1)
        if host in pool:
            raise CLIError(f"{path}:{number}: host {host!r} is listed twice (first at line {first_line[host]})")
        pool[host], first_line[host] = int(match.group(2)), number
    if not pool:
        raise CLIError(f"{path}: no hosts in the hostfile (expected lines 'HOST slots=N')")
    return pool


def _parse_spec(flag: str, text: str) -> dict[str, list[int]]:
    """``host1:0,1@host2`` -> {host1: [0, 1], host2: []} (slots sorted, duplicates dropped; [] = every slot)."""
    specs: dict[str, list[int]] = {}
    for item in text.split("@"):
        host, sep, slots = item.partition(":")
        if not host or ":" in slots or (sep and not slots):
            raise CLIError(f"{flag} {text!r}: bad node spec {item!r} (expected HOST or HOST:SLOT[,SLOT...])")
        try:
            numbers = [int(s) for s in slots.split(",")] if sep else []
        except ValueError:
            raise CLIError(f"{flag} {text!r}: slots of {host!r} must be integers, got {slots!r}") from None
        specs[host] = sorted(set(specs.get(host, []) + numbers))
    return specs


def select_resources(pool: dict[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> dict[str, list[int]]:
    """The slots the job runs on, host -> slot ids, as DeepSpeed's `parse_inclusion_exclusion` then
    `apply_num_nodes_and_gpus` make them; every refusal is one line naming the flag."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise CLIError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if include and exclude:
        raise CLIError("--include and --exclude are mutually exclusive")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if include or exclude:
        flag, text = ("--include", include) if include else ("--exclude", exclude)
        chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in active.items()}
        for host, slots in _parse_spec(flag, text).items():
            if host not in active:
                raise CLIError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(active)})")
            for slot in slots:
                if slot not in active[host]:
                    raise CLIError(f"{flag}: host {host!r} has no slot {slot} (slots 0..{len(active[host]) - 1})")
            if include:
                chosen[host] = slots or active[host]
            else:
                chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
        active = {host: chosen[host] for host in active if chosen.get(host)}
    if num_nodes > 0:
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = {host: list(range(num_gpus)) for host in active}
    if not active:
        raise CLIError("no slots left to run on after --include/--exclude")
    return active


def local_slots(nproc: int) -> int:
    """The slot count of this machine when no hostfile is given: its GPUs, else --nproc (CPU ranks)."""
    try:
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    return count or nproc


def is_this_host(host: str) -> bool:
    """Whether `host` names this machine (localhost, a loopback address, its hostname or fully qualified name)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {name.split(".")[0] for name in names}
    return host in names


def read_deepspeed_env(home: Optional[str] = None, cwd: Optional[str] = None) -> dict[str, str]:
    """NAME -> VALUE of the `.deepspeed_env` files where DeepSpeed reads them (the home directory, then the
    current one; ``$DS_ENV_FILE`` names the file). Blank lines and ``#`` comments are skipped; a line without
    ``=`` is one error naming the file and line."""
    name = os.getenv("DS_ENV_FILE", ".deepspeed_env")
    found: dict[str, str] = {}
    for directory in (os.path.expanduser("~") if home is None else home, "." if cwd is None else cwd):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip() or line.strip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise CLIError(f"{path}:{number}: bad line {line.strip()!r}: expected NAME=VALUE")
            found[key.strip()] = value.strip()
    return found
