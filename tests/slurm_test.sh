#!/usr/bin/env bash
# Slurm: starts a one-node cluster (munged, slurmctld, slurmd, with a
# generated slurm.conf on free ports; installs slurm-wlm and munge when
# missing), submits the README's sbatch script, which runs ddp_rpc with
# `srun` (5 tasks, each finding its role in SLURM_PROCID, SLURM_NTASKS and
# the first host of the node list, with no wrapper), checks that the master
# printed the table, and tears the cluster down. Needs root.
#   tests/slurm_test.sh bazel-bin/benchmarks/ddp_rpc
set -euo pipefail
bin=$(readlink -f "${1:?usage: slurm_test.sh DDP_RPC_BINARY}")
[ "$(id -u)" -eq 0 ] || { echo "slurm_test: needs root" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "slurm_test: installing slurm-wlm and munge" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2
fi

dir=$(mktemp -d /tmp/ddprpc-slurm.XXXXXX)
started_munged=0
cleanup() {
  for d in slurmd slurmctld; do
    [ -f "$dir/$d.pid" ] && kill "$(cat "$dir/$d.pid")" 2>/dev/null || true
  done
  if [ "$started_munged" = 1 ] && [ -f "$dir/munged.pid" ]; then
    kill "$(cat "$dir/munged.pid")" 2>/dev/null || true
  fi
  sleep 1
  rm -rf "$dir"
}
trap cleanup EXIT

# munged (a running one is used as it is).
if ! munge -n >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged --pid-file="$dir/munged.pid" 2>/dev/null ||
    runuser -u munge -- /usr/sbin/munged
  started_munged=1
  [ -f "$dir/munged.pid" ] || pgrep -n munged > "$dir/munged.pid"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<CONF
ClusterName=ddprpc-test
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmdSpoolDir=$dir/spool
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=30 State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld
slurmd
for _ in $(seq 60); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 0.5
done
sinfo -h -o %t | grep -q idle || { echo "slurm_test: the node never became idle"; cat "$dir"/*.log; exit 1; }

# The README's sbatch script.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/job.token"
cat > "$dir/ddp_rpc.sbatch" <<SCRIPT
#!/bin/bash
#SBATCH --job-name=ddp_rpc
#SBATCH --ntasks=5
#SBATCH --overcommit
#SBATCH --time=10
# The job's secret, readable on every node.
export DDPRPC_AUTH_TOKEN_FILE=$dir/job.token
srun $bin --trainers=2 --ps=2 --iters=10 --warmup=1 --pytorch=false --json=$dir/ddp_rpc.json
SCRIPT
start=$(date +%s)
rc=0
timeout 300 sbatch --wait --chdir="$dir" --output="$dir/job.out" "$dir/ddp_rpc.sbatch" || rc=$?
echo "slurm_test: sbatch exited $rc after $(( $(date +%s) - start )) s; the job's output:"
cat "$dir/job.out"
[ "$rc" -eq 0 ] || { echo "slurm_test: FAILED: the job failed"; exit 1; }
grep -qE '^ *All: +p50: ' "$dir/job.out" || { echo "slurm_test: FAILED: no All row"; exit 1; }
for t in 0 1; do
  grep -qE "^ *Trainer$t: +p50: " "$dir/job.out" || { echo "slurm_test: FAILED: no Trainer$t row"; exit 1; }
done
grep -q '"all"' "$dir/ddp_rpc.json" || { echo "slurm_test: FAILED: no JSON"; exit 1; }
echo "slurm_test: PASSED (5 tasks under srun, one table)"
