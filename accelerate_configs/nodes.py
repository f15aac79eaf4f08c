"""Nodes on one machine: N network namespaces, each with an address, a hostname and a hosts file of
its own, joined by a bridge in a namespace of its own, with no route to anything else. A rehearsal
of a multi-node launch (the network stack per node, names that resolve, an interface to choose) on
one Linux machine, as root.

    python accelerate_configs/nodes.py up 2          # nodes node1, node2 at 10.201.0.1, .2
    python accelerate_configs/nodes.py run 1 -- accelerate launch --config_file \\
        accelerate_configs/2nodes_4gpu.yaml --num_machines 2 --num_processes 2 --machine_rank 0 \\
        --main_process_ip node1 scripts/train_ddp.py --dataset synthetic --output-dir runs/two
    python accelerate_configs/nodes.py run 2 -- accelerate launch ... --machine_rank 1 ...
    python accelerate_configs/nodes.py down          # namespaces, hosts files, processes: gone

Each node's interface is eth0 (GLOO_SOCKET_IFNAME=eth0, NCCL_SOCKET_IFNAME=eth0 name it); its hosts
file (/etc/netns/NAME/hosts, which `ip netns exec` puts over /etc/hosts) names every node. `up
--loopback-name` writes each node's own name as 127.0.1.1 instead, as Debian's installer does: the
hostname trap, in which gloo advertises an address the other nodes cannot reach. The nodes share
the machine's disk; a run's folder on it is not what separate nodes have.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

PREFIX = "mgc"  # the namespaces' names: mgc-bridge, mgc-node1, ...
SUBNET = "10.201.0"
NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


def names(prefix: str = PREFIX) -> list[str]:
    """This machine's namespaces of ``prefix``, the bridge's last."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found = sorted(name for name in listed if name.startswith(f"{prefix}-node"))
    return found + [name for name in listed if name == f"{prefix}-bridge"]


def why_not() -> str | None:
    """Why nodes cannot be made here, in a few words, or None: they can."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "network namespaces need Linux and iproute2's ip"
    probe = f"{PREFIX}-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed ({made.stderr.strip() or made.returncode}): run as root"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def up(count: int, loopback_name: bool = False, prefix: str = PREFIX) -> list[str]:
    """``count`` nodes (node1 ... at SUBNET.1 ...), after taking down any of ``prefix``'s; their
    hostnames. Anything that fails takes down what was made."""
    down(prefix)
    bridge, hostnames = f"{prefix}-bridge", [f"node{k}" for k in range(1, count + 1)]
    try:
        subprocess.run(["ip", "netns", "add", bridge], check=True, capture_output=True)
        _ip("link", "add", "br0", "type", "bridge", namespace=bridge)
        _ip("link", "set", "br0", "up", namespace=bridge)
        for k, hostname in enumerate(hostnames, start=1):
            node = f"{prefix}-{hostname}"
            subprocess.run(["ip", "netns", "add", node], check=True, capture_output=True)
            _ip("link", "add", "eth0", "netns", node, "type", "veth", "peer", "name", f"port{k}",
                "netns", bridge)
            _ip("addr", "add", f"{SUBNET}.{k}/24", "dev", "eth0", namespace=node)
            for link in ("eth0", "lo"):
                _ip("link", "set", link, "up", namespace=node)
            _ip("link", "set", f"port{k}", "master", "br0", namespace=bridge)
            _ip("link", "set", f"port{k}", "up", namespace=bridge)
            (NETNS_ETC / node).mkdir(parents=True, exist_ok=True)
            others = "".join(f"{SUBNET}.{j} node{j}\n" for j in range(1, count + 1)
                             if j != k or not loopback_name)
            own = f"127.0.1.1 {hostname}\n" if loopback_name else ""
            (NETNS_ETC / node / "hosts").write_text(f"127.0.0.1 localhost\n{own}{others}")
    except (OSError, subprocess.CalledProcessError):
        down(prefix)
        raise
    return hostnames


def command(node: int, argv: list[str], prefix: str = PREFIX) -> list[str]:
    """``argv`` run on node ``node``: in its namespace, with its hostname (a UTS namespace)."""
    return ["ip", "netns", "exec", f"{prefix}-node{node}", "unshare", "--uts", "sh", "-c",
            f'hostname node{node} && exec "$@"', "sh", *argv]


def down(prefix: str = PREFIX) -> None:
    """Every namespace of ``prefix`` gone, with the processes in it and its hosts file."""
    for name in names(prefix):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    made = sub.add_parser("up", help="make N nodes (taking down those made before)")
    made.add_argument("count", type=int)
    made.add_argument("--loopback-name", action="store_true",
                      help="each node's own name at 127.0.1.1 in its hosts file: the hostname trap")
    ran = sub.add_parser("run", help="run a command on node K: run K -- COMMAND ...")
    ran.add_argument("node", type=int)
    ran.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="take the nodes down, with every process in them")
    args = parser.parse_args()
    if args.action == "down":
        down()
        return 0
    if why := why_not():
        print(f"error: cannot make nodes here: {why}", file=sys.stderr)
        return 1
    if args.action == "up":
        hostnames = up(args.count, args.loopback_name)
        print(f"nodes {', '.join(hostnames)} at {SUBNET}.1-{len(hostnames)}, interface eth0; "
              f"take them down with: python {sys.argv[0]} down")
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return subprocess.run(command(args.node, argv)).returncode


if __name__ == "__main__":
    sys.exit(main())
