#!/usr/bin/env bash
# Start a one-node SLURM (slurmctld + slurmd) and munge on localhost, as root in a container: what
# tests/distributed/test_slurm.py submits its jobs to (they are skipped where no SLURM answers).
set -euo pipefail
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/munge /var/run/munge /var/log/munge /var/lib/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /etc/slurm
[ -f /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /var/run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for i in $(seq 1 30); do sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed" && exit 0; sleep 1; done
echo "slurm did not come up"; sinfo; tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; exit 1
