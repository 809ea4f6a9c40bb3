"""`zerotrain launch`: start the user's own training script on N local processes (or nodes).

``zerotrain launch --nproc 2 train.py --deepspeed_config ds.json`` runs
``python -m torch.distributed.run`` (PyTorch's own launcher and rendezvous) with this module
as the worker program; each worker then runs ``train.py`` as ``__main__`` with the
script's arguments, the launcher's environment variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...) and, as DeepSpeed's launcher does, ``--local_rank=N``.

DeepSpeed's launcher passes ``--local_rank`` to every script unless told not to, so a script
whose parser does not declare it fails. Here it is passed only to scripts that declare it:
when the script's source contains the option string ``"--local_rank"`` or ``"--local-rank"``
(quoted, as an ``add_argument`` call spells it), and the script's own arguments do not
already carry it. ``--no-local-rank`` never passes it. Scripts that read ``LOCAL_RANK`` from the
environment (torchrun's way) work either way.
"""
from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path
from typing import Optional, Sequence

# Marks where the worker's own flags end and the script begins; torchrun keeps it in the arguments
# it passes on, and its parser treats nothing after it as one of its own options (argparse would
# otherwise reject a script option that abbreviates one of torchrun's, such as `--nproc`).
_SCRIPT_SEPARATOR = "--"
_PASS_LOCAL_RANK = "--pass-local-rank"
_DECLARES_LOCAL_RANK = re.compile(r"""["']--local[-_]rank["']""")


def declares_local_rank(script: str) -> bool:
    """True when the script's source names the option `--local_rank` / `--local-rank` in quotes."""
    try:
        text = Path(script).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return bool(_DECLARES_LOCAL_RANK.search(text))


def _has_local_rank(script_args: Sequence[str]) -> bool:
    return any(re.match(r"--local[-_]rank(=|$)", arg) for arg in script_args)


def worker_target(script: str, script_args: Sequence[str], pass_local_rank: bool = True) -> list[str]:
    """What torchrun starts in every worker: this module, then the script and its arguments."""
    flags = [_PASS_LOCAL_RANK] if pass_local_rank and declares_local_rank(script) and not _has_local_rank(script_args) else []
    return ["-m", "zerotrain.launcher", *flags, _SCRIPT_SEPARATOR, os.path.abspath(script), *script_args]


def run_worker(argv: Optional[Sequence[str]] = None) -> None:
    """Inside one worker: run the script as `__main__`, as `python script.py ARGS` would."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pass_local_rank = False
    while argv and argv[0].startswith("-") and argv[0] != _SCRIPT_SEPARATOR:
        flag = argv.pop(0)
        if flag != _PASS_LOCAL_RANK:
            raise SystemExit(f"zerotrain.launcher: unknown worker flag {flag!r}")
        pass_local_rank = True
    # torchrun's parser consumes the separator when it directly follows the module name (no worker flag):
    # then the script comes first
    if argv and argv[0] == _SCRIPT_SEPARATOR:
        argv.pop(0)
    if not argv:
        raise SystemExit("zerotrain.launcher: usage: python -m zerotrain.launcher [--pass-local-rank] -- SCRIPT [ARGS]")
    script, script_args = argv[0], argv[1:]
    if pass_local_rank:
        script_args = [*script_args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(script)  # what `python script.py` puts first on the path
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as exc:  # zerotrain's usage errors: one line, once for the job, as `zerotrain train` ends
        from .command import report_error, usage_error_status
        from .elastic import record_failure

        status = usage_error_status(exc)
        if status is None:  # anything else keeps its traceback: in the agent's report under this rank (@record's)
            if record_failure(exc):
                sys.exit(1)
            raise
        sys.exit(report_error(str(exc), status))
    _end_like_the_commands()


def _end_like_the_commands() -> None:
    """After the script returned normally with torch.distributed still up: a barrier, then the groups torn down,
    as `zerotrain train` ends. `zerotrain.dist.destroy_process_group` also collects the finished script's
    namespace (garbage in a cycle once `run_path` returns), so its engine's groups are destroyed and gloo's worker
    threads joined now: a worker still holding a finished collective's tensors when the interpreter finalizes
    cannot take the GIL to drop them and aborts the rank (SIGABRT after a complete run, ~1 in 30 under load)."""
    from . import dist  # imported here: a script that never starts torch.distributed loads none of it

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run_worker()
