"""A SLURM cluster on one machine: two nodes (network namespaces, accelerate_configs/nodes.py), a
slurmd on each, slurmctld on node1 and one munged for all, with a configuration of their own in a
state folder. A rehearsal of a SLURM batch script (its signals, requeue, scancel, a node lost) on
one Linux machine, as root, before it runs on a cluster that costs.

    python accelerate_configs/slurm_cluster.py up          # node1, node2 idle, partition main
    python accelerate_configs/slurm_cluster.py run 1 -- sbatch --gpus-per-node=0 \\
        --cpus-per-task=1 accelerate_configs/slurm_2nodes.sh --dataset synthetic
    python accelerate_configs/slurm_cluster.py run 1 -- squeue      # sinfo, scontrol, scancel
    python accelerate_configs/slurm_cluster.py down        # daemons, jobs, nodes, state: gone

The clients (sbatch, squeue, scontrol, scancel, sinfo) reach the controller from a node only, and
read the cluster's slurm.conf through SLURM_CONF: `run K -- COMMAND` runs COMMAND on node K with it
set. A job keeps SLURM_CONF and the rest of the environment it was submitted with (sbatch's
--export=ALL), so the PATH to `accelerate` too. The nodes share the machine's disk and CPUs: each
node has every core of the machine. No GRES: ask for no GPUs (sbatch --gpus-per-node=0).
Without accounting (slurmdbd) there is no sacct: `scontrol show job` holds a job for MinJobAge
after its end, and jobcomp.log (jobcomp/filetxt) records each end, a requeue too.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nodes  # noqa: E402

PREFIX = "mgcs"  # its namespaces: mgcs-node1, ...; the tests make theirs under other prefixes
STATE = Path("/run/mgc-slurm")
NEEDED = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
SBIN = "/usr/sbin:/sbin"  # where Debian puts the daemons, off a user's PATH

# Short waits, so that a rehearsal takes seconds where a cluster's defaults take minutes: a
# requeued job may start again cred_expire + 1 s after its requeue (120 s by default: the batch
# credential of its last start must have expired; src/slurmctld/job_mgr.c), and the scheduler
# looks at the queue every sched_interval seconds (60 by default). The time limit's signal
# (--signal=B:USR1@N) still comes from slurmctld's check every 30 s (PERIODIC_TIMEOUT,
# src/slurmctld/slurmctld.h, not a setting), which sends it once the job is within N + 30 s of its
# limit: N to N + 30 s before it, as on any cluster of SLURM 22.05. KillWait (SIGTERM to SIGKILL)
# is the default's 30 s. SlurmctldDebug=debug: the log says when each signal was sent.
SLURM_CONF = """\
ClusterName=mgc
SlurmctldHost=node1({subnet}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket,cred_expire=10
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/%n/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/%n/slurmd.log
SlurmctldDebug=debug
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={state}/jobcomp.log
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
KillWait=30
MessageTimeout=5
SlurmdTimeout=30
MinJobAge=600
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName=node[1-{count}] NodeAddr={subnet}.[1-{count}] CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes=node[1-{count}] Default=YES MaxTime=INFINITE State=UP
"""
# slurmd's cgroup plugin starts only as cgroup/v1 where cgroup v1 hierarchies are mounted (a hybrid
# layout): its autodetection picks v2 there, which fails. Nothing is confined: proctrack/linuxproc
# and task/none above.
CGROUP_CONF = "CgroupPlugin={plugin}\n"


def why_not() -> str | None:
    """Why a cluster cannot be made here, in a few words, or None: it can."""
    if why := nodes.why_not():
        return why
    path = f"{os.environ.get('PATH', '')}:{SBIN}"
    missing = [name for name in NEEDED if shutil.which(name, path=path) is None]
    if missing:
        return (f"SLURM or munge is not installed ({', '.join(missing)} not found): apt-get "
                "install slurmd slurmctld slurm-client munge")
    return None


def environ(state: Path = STATE, base: dict | None = None) -> dict:
    """``base`` (this process's environment) as a client or a daemon of the cluster in ``state``
    needs it: SLURM_CONF, and the daemons on PATH. A job submitted with it keeps it all."""
    base = os.environ if base is None else base
    return {**base, "SLURM_CONF": str(state / "slurm.conf"),
            "PATH": f"{base.get('PATH', '')}:{SBIN}"}


def command(node: int, argv: list[str], prefix: str = PREFIX) -> list[str]:
    """``argv`` run on node ``node`` of the cluster (run it with environ())."""
    return nodes.command(node, argv, prefix=prefix)


def _start(node: int, argv: list[str], state: Path, prefix: str) -> None:
    done = subprocess.run(command(node, argv, prefix), env=environ(state), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} did not start ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")


def node_states(state: Path = STATE, prefix: str = PREFIX) -> dict[str, str]:
    """Each node's state as sinfo says it (idle, alloc, down ...), {} if it does not answer."""
    done = subprocess.run(command(1, ["sinfo", "-h", "-N", "-o", "%N %t"], prefix),
                          env=environ(state), capture_output=True, text=True)
    return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)


def _last_errors(state: Path) -> str:
    """The daemons' last error lines, for a cluster that did not start."""
    lines = [line for log in sorted(state.glob("**/*.log")) if log.name != "jobcomp.log"
             for line in log.read_text(errors="replace").splitlines()
             if "error" in line or "fatal" in line]
    return " | ".join(lines[-3:]) or f"no error in the logs of {state}"


def up(count: int = 2, state: Path = STATE, prefix: str = PREFIX, timeout: float = 60) -> list[str]:
    """``count`` nodes idle under a controller on node1, after taking down the cluster of ``state``
    and ``prefix`` if there was one; their names. Anything that fails takes down what was made."""
    down(state, prefix)
    hostnames = nodes.up(count, prefix=prefix)
    try:
        (state / "munge").mkdir(parents=True, mode=0o700)
        (state / "ctld").mkdir()
        for hostname in hostnames:
            (state / hostname).mkdir()
        (state / "slurm.conf").write_text(SLURM_CONF.format(
            subnet=nodes.SUBNET, state=state, count=count, cpus=os.cpu_count()))
        v1 = Path("/sys/fs/cgroup/cpu").is_dir()
        (state / "cgroup.conf").write_text(CGROUP_CONF.format(
            plugin="cgroup/v1" if v1 else "autodetect"))
        munge = state / "munge"
        subprocess.run(["mungekey", "--create", "--keyfile", str(munge / "munge.key")],
                       env=environ(state), check=True, capture_output=True)
        _start(1, ["munged", "--force", f"--socket={munge / 'munge.socket'}",
                   f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                   f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
               state, prefix)
        _start(1, ["slurmctld", "-c"], state, prefix)
        for k, hostname in enumerate(hostnames, start=1):
            _start(k, ["slurmd", "-N", hostname], state, prefix)
        deadline = time.time() + timeout
        while (states := node_states(state, prefix)) != {name: "idle" for name in hostnames}:
            if time.time() > deadline:
                raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s "
                                   f"({states or 'no answer'}): {_last_errors(state)}")
            time.sleep(0.5)
    except BaseException:
        down(state, prefix)
        raise
    return hostnames


def down(state: Path = STATE, prefix: str = PREFIX) -> None:
    """The cluster gone whatever its state: every process on its nodes (daemons, jobs), the nodes,
    the state folder."""
    nodes.down(prefix)
    shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", type=Path, default=STATE,
                        help=f"the cluster's folder: configuration, logs, spool (default: {STATE})")
    sub = parser.add_subparsers(dest="action", required=True)
    made = sub.add_parser("up", help="start the cluster (taking down the one there was)")
    made.add_argument("--nodes", type=int, default=2, help="how many nodes (default: 2)")
    ran = sub.add_parser("run", help="run a command on node K with the cluster's SLURM_CONF: "
                                     "run K -- COMMAND ...")
    ran.add_argument("node", type=int)
    ran.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="stop the cluster, its jobs and its nodes, remove its folder")
    args = parser.parse_args()
    if args.action == "down":
        down(args.state)
        return 0
    if why := why_not():
        print(f"error: cannot make a SLURM cluster here: {why}", file=sys.stderr)
        return 1
    if args.action == "up":
        if not 1 <= args.nodes <= 254:  # their addresses: SUBNET.1 to .254
            print(f"error: --nodes {args.nodes}: give 1 to 254", file=sys.stderr)
            return 1
        try:
            hostnames = up(args.nodes, args.state)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            print(f"error: the cluster did not start: {error}", file=sys.stderr)
            return 1
        print(f"SLURM nodes {', '.join(hostnames)} idle, partition main; submit with: python "
              f"{sys.argv[0]} run 1 -- sbatch ... (SLURM_CONF={args.state / 'slurm.conf'}); "
              f"stop with: python {sys.argv[0]} down")
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("error: run K -- COMMAND: no command given", file=sys.stderr)
        return 1
    made = [name.split("-")[-1] for name in nodes.names(PREFIX) if "-node" in name]
    if f"node{args.node}" not in made:
        print(f"error: no node {args.node}: the cluster's nodes are "
              f"{', '.join(made) or 'none (run up first)'}", file=sys.stderr)
        return 1
    return subprocess.run(command(args.node, argv), env=environ(args.state)).returncode


if __name__ == "__main__":
    sys.exit(main())
