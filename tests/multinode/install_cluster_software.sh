#!/usr/bin/env bash
# The cluster software the real-software tests drive (issue #46), installed by the test command (README, .ci/run)
# where it is ABSENT: Ray (the `ray` extra) into PYTHON's environment when PYTHON cannot find it, and, as root with
# apt-get, the Debian packages whose commands are missing: iproute2 (the network-namespace hosts), openssh-server
# (the ssh launch, Open MPI's and hydra's remote starts), openmpi-bin, mpich (its hydra `mpiexec.hydra`),
# slurm-wlm + munge. Best effort: a part it cannot do (not root, no apt-get, no network, a failed install) is one
# line on stderr and exit status 0; the tests that need it then skip, each with its own one-line hint. When
# everything is present it is a presence check only (no apt-get, no pip, no import of Ray): milliseconds.
# Installs only: it starts no daemon (the tests start their own sshd/munged/slurmctld/slurmd inside network
# namespaces, with keys made per run); a policy-rc.d keeps the packages' scripts from starting services.
#
#   tests/multinode/install_cluster_software.sh [PYTHON]      # PYTHON: the suite's interpreter (.venv/bin/python)
#
# ZEROTRAIN_INSTALL_CLUSTER_SOFTWARE=0 skips all of it. ZEROTRAIN_CLUSTER_SOFTWARE_PATH: the directories searched
# for the commands (default: $PATH, /usr/sbin, /sbin); tests/multinode/test_install_cluster_software.py points it
# at stubs.
set -uo pipefail
python="${1:-python3}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
[ "${ZEROTRAIN_INSTALL_CLUSTER_SOFTWARE:-1}" = 0 ] && exit 0
say() { echo "install_cluster_software: $*" >&2; }

# Ray: no root needed, only when PYTHON cannot find it (find_spec: no import of Ray's ~10 s of modules)
if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("ray") is None)' 2>/dev/null; then
  if ! said="$("$python" -m pip install -q -e "$repo[ray]" 2>&1)"; then
    say "pip could not install Ray (the ray extra: ${said##*$'\n'}); the Ray tests will skip"
  fi
fi

# The Debian packages, by the commands the tests run (each command, the package that has it)
commands=(ip:iproute2 tc:iproute2 sshd:openssh-server ssh:openssh-client ssh-keygen:openssh-client
          ompi_info:openmpi-bin mpiexec.hydra:mpich munged:munge mungekey:munge slurmctld:slurm-wlm
          slurmd:slurm-wlm sbatch:slurm-wlm srun:slurm-wlm scontrol:slurm-wlm sinfo:slurm-wlm)
search="${ZEROTRAIN_CLUSTER_SOFTWARE_PATH:-$PATH:/usr/sbin:/sbin}"
found() {  # whether command $1 is an executable in one of $search's directories
  local dir
  IFS=: read -ra dirs <<< "$search"
  for dir in "${dirs[@]}"; do [ -n "$dir" ] && [ -x "$dir/$1" ] && return 0; done
  return 1
}
missing=()
for entry in "${commands[@]}"; do
  command="${entry%%:*}" package="${entry#*:}"
  found "$command" && continue
  [[ " ${missing[*]} " == *" $package "* ]] || missing+=("$package")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  say "${missing[*]} not installed; installing needs root and apt-get: the tests that drive them will skip"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
cleanup_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then  # 101: the packages' scripts start no service (sshd, munge, slurm)
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && cleanup_policy=1
fi
trap '[ "$cleanup_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
if said="$(apt-get update -qq 2>&1 && apt-get install -y -qq --no-install-recommends "${missing[@]}" 2>&1)"; then
  say "installed ${missing[*]}"
else
  say "apt-get could not install ${missing[*]} (${said##*$'\n'}); the tests that drive them will skip"
fi
exit 0
