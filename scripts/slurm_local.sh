#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd + munge on localhost), for testing the example sbatch
# script for real. Needs root and Debian's slurm-wlm and munge packages.
#
#   bash scripts/slurm_local.sh install   # apt-get install slurm-wlm munge (if missing)
#   bash scripts/slurm_local.sh start     # write the config under $SLURM_LOCAL_DIR, start the daemons, wait for the node
#   bash scripts/slurm_local.sh stop      # stop the daemons
#
# Exports nothing: commands find the config through SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf (printed by `start`).
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/megatron-muon-slurm}"
CPUS="${SLURM_LOCAL_CPUS:-$(nproc)}"
NODE="$(hostname -s)"
CONF="$DIR/slurm.conf"

fail() { echo "slurm_local: $*" >&2; exit 1; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || fail "installing Slurm needs root (apt-get install slurm-wlm munge)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >"$DIR.apt.log" 2>&1 \
    || fail "apt-get install slurm-wlm munge failed; see $DIR.apt.log"
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat >"$CONF" <<EOF
ClusterName=megatron-muon-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  install
  write_config
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /etc/munge /var/log/munge /run/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chown -R munge:munge /etc/munge /var/log/munge /run/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    (command -v runuser >/dev/null && runuser -u munge -- munged) || munged --force \
      || fail "munged did not start (see /var/log/munge/munged.log)"
  fi
  export SLURM_CONF="$CONF"
  pgrep -x slurmctld >/dev/null || slurmctld -f "$CONF" || fail "slurmctld did not start (see $DIR/log/slurmctld.log)"
  pgrep -x slurmd >/dev/null || slurmd -f "$CONF" || fail "slurmd did not start (see $DIR/log/slurmd.log)"
  for _ in $(seq 60); do
    state="$(sinfo -h -N -o '%t' 2>/dev/null | head -n 1 || true)"
    case "$state" in idle|mix|alloc) echo "SLURM_CONF=$CONF"; return 0 ;; esac
    sleep 1
  done
  fail "the node did not become idle within 60 s (sinfo says '${state:-nothing}'; see $DIR/log/)"
}

stop() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
  for _ in $(seq 20); do  # they finish shutting down after the signal; the next start must not find them
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || pgrep -x munged >/dev/null || return 0
    sleep 0.5
  done
  echo "slurm_local: slurmd/slurmctld/munged still running 10 s after stop" >&2
}

case "${1:-}" in
  install) mkdir -p "$(dirname "$DIR")"; install ;;
  start) start ;;
  stop) stop ;;
  *) fail "usage: $0 install|start|stop" ;;
esac
