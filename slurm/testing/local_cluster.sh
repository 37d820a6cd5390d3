#!/usr/bin/env bash
# A real one-node SLURM on this machine, for tests/cluster/test_slurm_real.py (and for trying slurm/train.sbatch
# by hand): Debian's slurm-wlm and munge, a localhost slurm.conf without cgroups or accounting, and the
# three daemons (munged, slurmctld, slurmd) run as root.
#
#   bash slurm/testing/local_cluster.sh          # = up: install if missing, configure, start, wait for idle
#   bash slurm/testing/local_cluster.sh status   # the node and the daemons
#   bash slurm/testing/local_cluster.sh down     # stop the daemons this script started, remove its slurm.conf
#
# Nothing else starts it: `python -m pytest` only uses a cluster that is up (tests/cluster/test_slurm_real.py skips
# without one, and fails instead when MGRPO_REQUIRE_SLURM is set); .ci/run runs `up` before the tests and
# `down` after them.
#
# `up` is idempotent: with the packages installed, the config unchanged and the daemons answering it
# does nothing (about a second). It needs root and Debian's package repository only for the first
# install (apt-get update once, then apt-get install). The node is this machine with the CPUs, sockets
# and memory `slurmd -C` reports, in one partition `local`.
#
# Knobs: MGRPO_SLURM_STATE      state, spool and log directory      default /var/spool/mgrpo-slurm
#        MGRPO_SLURM_UP_TIMEOUT seconds to wait for an idle node     default 120
#        MGRPO_SLURMCTLD_PORT / MGRPO_SLURMD_PORT                    default 6817 / 6818
#        MGRPO_SLURM_FORCE_CONF=1  replace an /etc/slurm/slurm.conf this script did not write
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
state=${MGRPO_SLURM_STATE:-/var/spool/mgrpo-slurm}
conf=/etc/slurm/slurm.conf   # Debian's compiled-in default: sinfo, sbatch and srun find it without SLURM_CONF
marker="mgrpo local test cluster (slurm/testing/local_cluster.sh)"
up_timeout=${MGRPO_SLURM_UP_TIMEOUT:-120}
host=$(hostname -s)

log() { printf '[local-slurm %s] %s\n' "$(date '+%T')" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# --- packages -------------------------------------------------------------------------------------------
have_packages() {
    command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged && command -v unmunge
} >/dev/null 2>&1

install_packages() {
    have_packages && return 0
    [[ $(id -u) == 0 ]] || die "slurm-wlm and munge are not installed and this is not root (apt-get needs root)"
    command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get (not Debian?)"
    log "installing slurm-wlm and munge (apt-get)"
    local t0=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    # Another apt-get on the machine holds the lock for a while: wait for it instead of failing.
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends slurm-wlm munge >/dev/null
    have_packages || die "apt-get install slurm-wlm munge finished but the daemons are not on PATH"
    log "installed in $((SECONDS - t0))s"
}

# --- munge ----------------------------------------------------------------------------------------------
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_ok && return 0
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating the munge key /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    fi
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    local i
    for i in $(seq 50); do munge_ok && return 0; sleep 0.2; done
    die "munged does not answer (munge -n | unmunge); see /var/log/munge/munged.log:
$(tail -n 20 /var/log/munge/munged.log 2>/dev/null)"
}

# --- slurm.conf -----------------------------------------------------------------------------------------
node_value() {  # a field of `slurmd -C` (this machine as slurmd sees it)
    local v
    v=$(slurmd -C | head -n 1 | tr ' ' '\n' | sed -n "s/^$1=//p")
    [[ -n "$v" ]] || die "slurmd -C does not report $1"
    printf '%s' "$v"
}

render_conf() {
    sed -e "s|@MARKER@|${marker}|" -e "s|@HOST@|${host}|g" -e "s|@STATE@|${state}|g" \
        -e "s|@CTLD_PORT@|${MGRPO_SLURMCTLD_PORT:-6817}|" -e "s|@SLURMD_PORT@|${MGRPO_SLURMD_PORT:-6818}|" \
        -e "s|@CPUS@|$(node_value CPUs)|" -e "s|@BOARDS@|$(node_value Boards)|" \
        -e "s|@SOCKETS@|$(node_value SocketsPerBoard)|" -e "s|@CORES@|$(node_value CoresPerSocket)|" \
        -e "s|@THREADS@|$(node_value ThreadsPerCore)|" -e "s|@MEMORY@|$(node_value RealMemory)|" \
        "$here/slurm.conf.in"
}

# Writes slurm.conf; returns 0 when it changed (the running daemons must be restarted to read it).
write_conf() {
    local new
    new=$(render_conf)
    if [[ -f "$conf" ]] && ! grep -qF "$marker" "$conf" && [[ -z "${MGRPO_SLURM_FORCE_CONF:-}" ]]; then
        die "$conf exists and was not written by this script; move it away or set MGRPO_SLURM_FORCE_CONF=1"
    fi
    [[ -f "$conf" && "$(cat "$conf")" == "$new" ]] && return 1
    install -d -m 0755 /etc/slurm
    printf '%s\n' "$new" > "$conf"
    log "wrote $conf (node ${host}: CPUs=$(node_value CPUs) RealMemory=$(node_value RealMemory))"
    return 0
}

# --- daemons --------------------------------------------------------------------------------------------
daemon_pid() {  # the pid in $state/<name>.pid if that process is alive and is <name>
    local name=$1 pid
    pid=$(cat "$state/$name.pid" 2>/dev/null) || return 1
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name"* ]] || return 1
    printf '%s' "$pid"
}

stop_daemon() {
    local name=$1 pid i
    pid=$(daemon_pid "$name") || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    log "$name did not stop in 20s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

start_daemons() {
    install -d -m 0755 "$state" "$state/ctld" "$state/d" "$state/log"
    if ! daemon_pid slurmctld >/dev/null; then
        log "starting slurmctld"
        slurmctld || die "slurmctld did not start; see $state/log/slurmctld.log:
$(tail -n 20 "$state/log/slurmctld.log" 2>/dev/null)"
    fi
    if ! daemon_pid slurmd >/dev/null; then
        log "starting slurmd"
        slurmd || die "slurmd did not start; see $state/log/slurmd.log:
$(tail -n 20 "$state/log/slurmd.log" 2>/dev/null)"
    fi
}

node_state() { sinfo --noheader --Node --nodes="$host" --format=%T 2>/dev/null | head -n 1; }

wait_for_node() {
    local t0=$SECONDS s=""
    while (( SECONDS - t0 < up_timeout )); do
        s=$(node_state || true)
        case "$s" in
            idle|mixed|allocated|completing) log "node ${host} is ${s} ($((SECONDS - t0))s)"; return 0 ;;
            drain*|drained*|fail*|inval*)
                die "node ${host} is ${s}: $(scontrol show node "$host" | grep -o 'Reason=.*')" ;;
        esac
        for d in slurmctld slurmd; do
            daemon_pid "$d" >/dev/null || die "$d exited; see $state/log/$d.log:
$(tail -n 20 "$state/log/$d.log" 2>/dev/null)"
        done
        sleep 0.5
    done
    die "node ${host} not idle after ${up_timeout}s (state '${s}'):
$(scontrol show node "$host" 2>&1 | head -n 20)
--- slurmctld.log
$(tail -n 15 "$state/log/slurmctld.log" 2>/dev/null)
--- slurmd.log
$(tail -n 15 "$state/log/slurmd.log" 2>/dev/null)"
}

up() {
    local t0=$SECONDS
    install_packages
    start_munge
    if write_conf; then
        stop_daemon slurmd
        stop_daemon slurmctld
    fi
    start_daemons
    wait_for_node
    log "up in $((SECONDS - t0))s: $(sinfo --noheader --format='partition %P, %D node(s) %N, %T, CPUs %c, memory %m MB')"
}

status() {
    local d pid
    for d in slurmctld slurmd; do
        if pid=$(daemon_pid "$d"); then echo "$d: running (pid $pid)"; else echo "$d: not running"; fi
    done
    if munge_ok; then echo "munged: running"; else echo "munged: not answering"; fi
    sinfo --Node --long 2>&1 || true
}

down() {
    stop_daemon slurmd
    stop_daemon slurmctld
    if munge_ok; then
        log "stopping munged"
        runuser -u munge -- /usr/sbin/munged --stop >/dev/null || true
    fi
    # The configuration `up` wrote goes too (a slurm.conf of someone else's stays); logs stay in $state.
    if [[ -f "$conf" ]] && grep -qF "$marker" "$conf"; then
        rm -f "$conf"
        log "removed $conf"
    fi
}

case "${1:-up}" in
    up) up ;;
    status) status ;;
    down) down ;;
    *) die "usage: $0 [up|status|down]" ;;
esac
