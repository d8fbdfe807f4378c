#!/usr/bin/env bash
# Stop what launch/slurm-up.sh started, and nothing else: the daemons recorded in /run/twinrun-slurm/started
# ("name pidfile comm pid" lines), by pid from their pidfiles, in the order slurmd, slurmctld, slurmdbd,
# mariadbd, munged. Daemons somebody else started are left alone. Idempotent.
#   bash launch/slurm-down.sh
set -u
STATE_DIR=/run/twinrun-slurm
STATE=$STATE_DIR/started

[ "$(id -u)" = 0 ] || { echo "slurm-down.sh must run as root" >&2; exit 2; }
if [ ! -e "$STATE" ]; then
  echo "slurm-down: nothing to stop ($STATE does not exist: already stopped, or slurm-up.sh started nothing)"
  exit 0
fi
exec 9>"$STATE_DIR/lock"
flock -w 120 9 || { echo "another slurm-up/down holds $STATE_DIR/lock" >&2; exit 1; }

# running PID: exists and is not a zombie (PID 1 here may reap orphans late; a zombie keeps /proc/PID and its comm)
running() { local st; st=$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null) || return 1; [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]; }
alive() { local pid; pid=$(cat "$1" 2>/dev/null) || return 1; [ -n "$pid" ] && running "$pid" && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ]; }

# Cancel every job first when we stop a slurm daemon: a job's slurmstepd outlives slurmd and would keep
# running (with its srun/python children) after the cluster is gone.
if grep -qE '^(slurmd|slurmctld) ' "$STATE" && ids=$(squeue -h -o %A 2>/dev/null); then
  ids=$(echo "$ids" | sort -u)
  if [ -n "$ids" ]; then
    echo "cancelling jobs: $(echo $ids)"
    # shellcheck disable=SC2086
    scancel $ids
    # KillWait=5: SIGKILL comes 5 s after SIGTERM, and submitit ignores SIGTERM
    for _ in $(seq 1 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
    [ -n "$(squeue -h 2>/dev/null)" ] && echo "warning: jobs still listed after 30 s: $(squeue -h -o %A | tr '\n' ' ')" >&2
  fi
fi

for name in slurmd slurmctld slurmdbd mariadbd munged; do
  line=$(grep "^$name " "$STATE") || continue
  read -r _ pidfile comm rec_pid <<<"$line"
  if ! alive "$pidfile" "$comm"; then echo "$name: not running"; continue; fi
  pid=$(cat "$pidfile")
  if [ "${rec_pid:--}" != - ] && [ "$pid" != "$rec_pid" ]; then
    echo "$name: pid $pid is not the one slurm-up.sh started ($rec_pid); left alone"; continue
  fi
  t0=$(date +%s%N); kill -TERM "$pid"
  for _ in $(seq 1 150); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then
    echo "$name ($pid) ignored SIGTERM for 15 s, sending SIGKILL"; kill -KILL "$pid" 2>/dev/null
    for _ in $(seq 1 50); do running "$pid" || break; sleep 0.1; done
  fi
  echo "stopped $name ($pid) in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
done
rm -f "$STATE"
