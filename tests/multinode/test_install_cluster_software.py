"""The test command's install of the cluster software (tests/multinode/install_cluster_software.sh, issue #46):
what it installs where something is absent, and that it never fails the test command, without uninstalling
anything. The script looks for the commands in ZEROTRAIN_CLUSTER_SOFTWARE_PATH (here: a directory of stubs, the
commands "present"), and runs `id`, `apt-get` and PYTHON from PATH (here: stubs that log their arguments), so each
case is a machine with some software absent, root or not, apt-get or pip working or failing."""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

import slurm
from test_dropin_api import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tests", "multinode", "install_cluster_software.sh")


def _commands() -> dict[str, str]:
    """The script's command -> package table."""
    table = re.search(r"^commands=\((.*?)\)", open(SCRIPT).read(), flags=re.S | re.M).group(1)
    return dict(entry.split(":") for entry in table.split())


def _stub(path, text: str) -> None:
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(0o755)


def _run(base, case: str, absent=(), uid=0, apt_status=0, ray_found=True, pip_status=0, env=None):
    """The script on a machine where the commands `absent` are missing (stubs under `base`/`case`): returns (exit
    status, stderr, the apt-get calls, the PYTHON calls)."""
    tmp_path = base / case
    have, tools = tmp_path / "have", tmp_path / "tools"
    have.mkdir(parents=True)
    tools.mkdir()
    for command in _commands():
        if command not in absent:
            _stub(have / command, "exit 0")
    _stub(tools / "id", f'[ "$1" = -u ] && echo {uid}')
    _stub(tools / "apt-get", f'echo "$@" >> {tmp_path}/apt.log; echo "E: apt says no" >&2; exit {apt_status}'
          if apt_status else f'echo "$@" >> {tmp_path}/apt.log')
    _stub(tools / "python", f'echo "$@" >> {tmp_path}/python.log\n'
                            f'case "$1" in -c) exit {0 if ray_found else 1};; '
                            f'-m) [ {pip_status} = 0 ] || echo "ERROR: No matching distribution found for ray" >&2; '
                            f'exit {pip_status};; esac')
    run_env = {"PATH": f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin", "ZEROTRAIN_CLUSTER_SOFTWARE_PATH": str(have),
               **(env or {})}
    proc = subprocess.run(["bash", SCRIPT, str(tools / "python")], env=run_env, capture_output=True, text=True,
                          timeout=60)
    logs = [(tmp_path / name).read_text().splitlines() if (tmp_path / name).exists() else []
            for name in ("apt.log", "python.log")]
    return proc.returncode, proc.stderr, *logs


def test_everything_present_is_a_presence_check_only(tmp_path):
    """Nothing absent: no output, no apt-get, no pip (PYTHON asked once whether it finds Ray), exit 0."""
    status, err, apt, python = _run(tmp_path, "all")
    assert (status, err, apt) == (0, "", [])
    assert len(python) == 1 and python[0].startswith("-c import importlib.util"), python


def test_absent_packages_are_installed_by_apt_as_root(tmp_path):
    """Root with apt-get: one `apt-get update` and one install of exactly the absent commands' packages (each
    once, in the table's order), then one line saying so."""
    status, err, apt, _ = _run(tmp_path, "some", absent=("mpiexec.hydra", "munged", "mungekey", "sshd"))
    assert status == 0
    assert apt == ["update -qq", "install -y -qq --no-install-recommends openssh-server mpich munge"], apt
    assert err == "install_cluster_software: installed openssh-server mpich munge\n"


def test_a_failed_install_or_no_root_is_one_line_and_never_fails(tmp_path):
    """apt-get failing (no network, no such package) and a non-root user: one line naming the packages (and
    apt's last word), exit status 0, so the test command goes on and the tests skip with their own hints."""
    status, err, apt, _ = _run(tmp_path, "apt", absent=("ompi_info",), apt_status=100)
    assert status == 0 and apt == ["update -qq"], apt
    assert err == ("install_cluster_software: apt-get could not install openmpi-bin (E: apt says no); the tests "
                   "that drive them will skip\n"), err
    status, err, apt, _ = _run(tmp_path, "user", absent=("slurmd", "ip"), uid=1000)
    assert (status, apt) == (0, [])
    assert err == ("install_cluster_software: iproute2 slurm-wlm not installed; installing needs root and apt-get: "
                   "the tests that drive them will skip\n"), err
    status, err, apt, python = _run(tmp_path, "off", absent=("slurmd",), ray_found=False,
                                    env={"ZEROTRAIN_INSTALL_CLUSTER_SOFTWARE": "0"})
    assert (status, err, apt, python) == (0, "", [], [])  # opted out: nothing looked at


def test_ray_is_installed_from_the_ray_extra_when_python_cannot_find_it(tmp_path):
    """Ray absent: `pip install -e REPO[ray]` into PYTHON's environment, root or not; pip failing is one line."""
    status, err, apt, python = _run(tmp_path, "ok", ray_found=False, uid=1000)
    assert (status, err, apt) == (0, "", [])
    assert python[1:] == [f"-m pip install -q -e {REPO_ROOT}[ray]"], python
    status, err, _, python = _run(tmp_path, "fails", ray_found=False, pip_status=1)
    assert status == 0 and len(python) == 2
    assert err == ("install_cluster_software: pip could not install Ray (the ray extra: ERROR: No matching "
                   "distribution found for ray); the Ray tests will skip\n"), err


def test_the_table_covers_every_command_the_cluster_tests_check():
    """Each command whose absence makes a cluster test skip is in the script's table, so the test command
    installs what the skips name: the namespace tools (iproute2's; nsenter and unshare are util-linux, always
    there), sshd and ssh, Slurm's and munge's commands, Open MPI's and MPICH's."""
    table = _commands()
    needed = {"ip", "tc", "sshd", "ssh", "ssh-keygen", "ompi_info", "mpiexec.hydra", *slurm.DAEMONS}
    assert needed <= set(table), needed - set(table)
    assert {table[name] for name in ("ompi_info", "mpiexec.hydra", "sshd", "slurmd", "munged")} == {
        "openmpi-bin", "mpich", "openssh-server", "slurm-wlm", "munge"}


def test_on_this_machine_it_costs_nothing_when_everything_is_present():
    """The real script on this machine with the suite's Python: where every command is installed (this
    project's machine), it changes nothing and takes well under a second (no apt-get, no pip, no import of Ray)."""
    missing = [name for name in _commands()
               if not any(os.access(os.path.join(d, name), os.X_OK)
                          for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"] if d)]
    if missing:
        pytest.skip(f"not installed here: {' '.join(missing)} (the script would install them)")
    import importlib.util
    import sys

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here (the script would install it)")
    started = time.monotonic()
    proc = subprocess.run([SCRIPT, sys.executable], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert took < 5, took  # ~0.1 s quiet; 5 s leaves room for a loaded machine, apt-get update alone is more
