#!/usr/bin/env bash
# Start a single-node Slurm 22.05 cluster on this machine (Debian 12, root, no systemd). Idempotent.
#   bash launch/slurm-up.sh            # then: sinfo; stop with: bash launch/slurm-down.sh
#   SLURM_WITH_DBD=1 (default): also MariaDB + slurmdbd, so `sacct` works (submitit polls sacct).
#   SLURM_CPUS=N: advertise N CPUs (default: nproc). N > nproc uses SlurmdParameters=config_overrides.
# Every daemon this script starts is recorded in $STATE as "name pidfile comm pid"; slurm-down.sh stops
# only those. Daemons that were already running (started by somebody else) are used but not recorded.
set -euo pipefail
WITH_DBD=${SLURM_WITH_DBD:-1}
HOST=$(hostname -s)
NCPU=$(nproc)
CPUS=${SLURM_CPUS:-$NCPU}
MEM_MB=$(( $(awk '/^MemTotal/{print $2}' /proc/meminfo) / 1024 * 9 / 10 ))   # 90% of RAM, avoids "Low RealMemory" drain
STATE_DIR=/run/twinrun-slurm
STATE=$STATE_DIR/started

case "$WITH_DBD" in 0|1) ;; *) echo "SLURM_WITH_DBD=$WITH_DBD: expected 0 or 1" >&2; exit 2 ;; esac
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || { echo "SLURM_CPUS=$CPUS: expected a positive integer (default: nproc = $NCPU)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm-up.sh must run as root (it installs packages and starts daemons)" >&2; exit 2; }

# one up/down at a time (two pytest sessions starting the cluster at once would start daemons twice)
mkdir -p "$STATE_DIR"
exec 9>"$STATE_DIR/lock"
flock -w 120 9 || { echo "another slurm-up/down holds $STATE_DIR/lock" >&2; exit 1; }

# 1. packages (Debian 12: slurm 22.05.8, munge 0.5.15)
pkgs=(munge slurmctld slurmd slurm-client)
[ "$WITH_DBD" = 1 ] && pkgs+=(slurmdbd mariadb-server)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  apt-get update -qq
  # the postinst scripts start no service here (policy-rc.d exits 101); this script starts them
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# running PID: exists and is not a zombie (PID 1 here may reap orphans late; a zombie keeps /proc/PID and its comm)
running() { local st; st=$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null) || return 1; [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]; }
# alive PIDFILE COMM: the process from PIDFILE runs and is really COMM (guards against stale pidfiles / PID reuse)
alive() { local pid; pid=$(cat "$1" 2>/dev/null) || return 1; [ -n "$pid" ] && running "$pid" && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ]; }
stop_pid() { # PIDFILE COMM
  alive "$1" "$2" || return 0
  local pid; pid=$(cat "$1"); kill -TERM "$pid"
  for _ in $(seq 1 100); do running "$pid" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}
# record NAME PIDFILE COMM: called right after launching a daemon; waits (<= 10 s) for its pidfile, then
# replaces NAME's line in $STATE. Recorded even if the pid is unknown ("-"), so slurm-down.sh can still stop it.
record() {
  local pid=-
  for _ in $(seq 1 100); do alive "$2" "$3" && { pid=$(cat "$2"); break; }; sleep 0.1; done
  touch "$STATE"
  { grep -v "^$1 " "$STATE" || true; echo "$1 $2 $3 $pid"; } > "$STATE.new"
  mv "$STATE.new" "$STATE"
  echo "started $1 (pid $pid)"
}
# start NAME PIDFILE COMM CMD...: launch CMD unless COMM already runs from PIDFILE
start() {
  local name=$1 pidfile=$2 comm=$3; shift 3
  if alive "$pidfile" "$comm"; then
    if grep -q "^$name .* $(cat "$pidfile")\$" "$STATE" 2>/dev/null; then echo "$name already running (pid $(cat "$pidfile"))"
    else echo "$name already running (pid $(cat "$pidfile"), not started by slurm-up.sh: left alone by slurm-down.sh)"; fi
    return 0
  fi
  "$@" 9>&-   # the daemon must not inherit the lock
  record "$name" "$pidfile" "$comm"
}

# 2. slurm.conf (regenerated every time: hostname / CPU count may differ between machines)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
extra=""
[ "$CPUS" -gt "$NCPU" ] && extra="SlurmdParameters=config_overrides"
if [ "$WITH_DBD" = 1 ]; then acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
else acct="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"; fi
cat > /etc/slurm/slurm.conf.new <<CONF
ClusterName=localcluster
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs wait cred_expire+1 s before they are eligible again (default 120 s); minimum 5
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$acct
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# full scheduling pass every 5 s (default 60; backfill 30): a requeued job only starts in such a periodic pass
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
# memory not consumable: jobs without --mem do not each take the whole node
SelectTypeParameters=CR_Core
$extra
ReturnToService=2
KillWait=5
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf; then
  mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
  # restart with the new config; if somebody else had started them, the restarted ones are ours now
  for d in slurmd slurmctld; do
    alive /run/$d.pid $d && echo "slurm.conf changed: restarting $d"
    stop_pid /run/$d.pid $d
  done
else rm -f /etc/slurm/slurm.conf.new; fi

# 3. munge (Debian's postinst creates /etc/munge/munge.key; create one if missing)
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
fi
mkdir -p /run/munge; chown munge:munge /run/munge; chmod 755 /run/munge
start munged /run/munge/munged.pid munged runuser -u munge -- /usr/sbin/munged
for _ in $(seq 1 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge >/dev/null || { echo "munged not working; see /var/log/munge/munged.log" >&2; exit 1; }

# 4. MariaDB + slurmdbd (optional)
if [ "$WITH_DBD" = 1 ]; then
  mkdir -p /run/mysqld; chown mysql:root /run/mysqld
  launch_mariadbd() {
    setsid /usr/sbin/mariadbd --user=mysql --skip-networking --pid-file=/run/mysqld/mysqld.pid \
      --log-error=/var/log/slurm/mariadb.err </dev/null >/dev/null 2>&1 &
  }
  start mariadbd /run/mysqld/mysqld.pid mariadbd launch_mariadbd
  for _ in $(seq 1 100); do mariadb-admin ping >/dev/null 2>&1 && break; sleep 0.2; done
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
    || { echo "MariaDB not reachable; see /var/log/slurm/mariadb.err" >&2; exit 1; }
  cat > /etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
CONF
  chmod 600 /etc/slurm/slurmdbd.conf
  start slurmdbd /run/slurmdbd.pid slurmdbd /usr/sbin/slurmdbd
  for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.1; done
fi

# 5. slurmctld + slurmd (both daemonize and write their pidfiles)
start slurmctld /run/slurmctld.pid slurmctld /usr/sbin/slurmctld
start slurmd /run/slurmd.pid slurmd /usr/sbin/slurmd

# 6. wait until the node is usable
for i in $(seq 1 120); do
  st=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
  case "$st" in
    idle|mixed|allocated|completing) echo "slurm up: node $HOST $st, partition debug, $CPUS CPUs"; exit 0 ;;
    drained|draining|down*|drain*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.5
done
echo "slurm did not come up in 60 s; see /var/log/slurm/*.log (and /var/log/munge/munged.log)" >&2
sinfo -R >&2 || true; exit 1
