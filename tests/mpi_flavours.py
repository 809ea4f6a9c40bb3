"""Which MPI the tests can run here (issue #46): Open MPI's `mpirun` and MPICH's hydra, found whichever one
Debian's `mpirun` alternative points to (it points to Open MPI's or MPICH's, by priority, when both are installed,
and to the only one otherwise), each with its skip reason naming the package to install. A test puts the
`mpirun` it needs first on PATH (`mpirun_path`), so the Open MPI tests run with Open MPI's and the MPICH tests
with hydra whatever `mpirun` is; where the MPI is absent they skip. `zerotrain.hostfile.mpirun_kind` tells them
apart (the launcher uses it to refuse the other MPI's `mpirun` in one line)."""
from __future__ import annotations

import functools
import os
import shutil
from typing import Optional

from zerotrain.hostfile import mpirun_kind as _mpirun_kind

mpirun_kind = functools.lru_cache(maxsize=None)(_mpirun_kind)  # one `--version` per path per session

OPENMPI_HINT = "Open MPI is not installed (apt-get install -y openmpi-bin, or tests/multinode/install_cluster_software.sh)"
MPICH_HINT = "MPICH is not installed (apt-get install -y mpich, or tests/multinode/install_cluster_software.sh)"


def openmpi_mpirun(path: Optional[str] = None) -> Optional[str]:
    """Open MPI's `mpirun` on `path` (default: PATH): `mpirun` itself when it is Open MPI's, else Debian's
    `mpirun.openmpi`; None when there is none (only MPICH's, or no MPI)."""
    for name in ("mpirun", "mpirun.openmpi"):
        found = shutil.which(name, path=path)
        if found and mpirun_kind(found) == "openmpi":
            return found
    return None


def hydra_mpiexec(path: Optional[str] = None) -> Optional[str]:
    """MPICH's hydra on `path` (default: PATH): `mpiexec.hydra`, else an `mpirun` that is hydra; None when there
    is none (only Open MPI's, or no MPI)."""
    for name in ("mpiexec.hydra", "mpirun"):
        found = shutil.which(name, path=path)
        if found and mpirun_kind(found) == "hydra":
            return found
    return None


def openmpi_missing(path: Optional[str] = None) -> Optional[str]:
    """Why the Open MPI tests cannot run here (a skip reason), or None."""
    return None if openmpi_mpirun(path) else OPENMPI_HINT


def mpich_missing(path: Optional[str] = None) -> Optional[str]:
    """Why the MPICH (hydra) tests cannot run here (a skip reason), or None."""
    return None if hydra_mpiexec(path) else MPICH_HINT


def mpirun_path(bin_dir, target: str) -> str:
    """A PATH whose `mpirun` runs `target` (Open MPI's `mpirun` or hydra): a script in `bin_dir`, put first (a
    script, not a link: hydra finds its `hydra_pmi_proxy` next to the path it was started by)."""
    os.makedirs(bin_dir, exist_ok=True)
    wrapper = os.path.join(bin_dir, "mpirun")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec {target} "$@"\n')
    os.chmod(wrapper, 0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
