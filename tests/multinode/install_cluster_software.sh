#!/usr/bin/env bash
# The cluster software the real-software tests drive (issue #46), installed where it is absent: openssh-server
# (the ssh launch, Open MPI's and hydra's remote starts), openmpi-bin, mpich (its hydra `mpiexec.hydra`; Debian
# keeps Open MPI's `mpirun` as the `mpirun` alternative when both are installed), slurm-wlm + munge, and Ray in
# the given Python's environment (the `ray` extra). Needs root and apt-get; prints one line and exits 0 when it
# cannot install (the tests then skip, each with its own one-line hint). Installs only: it starts no daemon (the
# tests start their own sshd/munged/slurmctld/slurmd inside network namespaces, with keys made per run).
#
#   tests/multinode/install_cluster_software.sh [PYTHON]      # PYTHON: the suite's interpreter (.venv/bin/python)
#
# .ci/run calls it when ZEROTRAIN_INSTALL_CLUSTER_SOFTWARE=1 (docs/testing.md says why not always).
set -euo pipefail
python="${1:-python3}"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_cluster_software: needs root and apt-get; the cluster tests will skip" >&2
  exit 0
fi
missing=()
for pkg in openssh-server openmpi-bin mpich slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d 101: the packages' scripts start no service (sshd, munge, slurm) on a host with an init system
  cleanup_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && cleanup_policy=1
  fi
  trap '[ "$cleanup_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
"$python" -c "import ray" 2>/dev/null || "$python" -m pip install -q 'ray[train]>=2.60'
echo "install_cluster_software: ${missing[*]:-nothing} from apt; ray: $("$python" -c 'import ray; print(ray.__version__)')"
