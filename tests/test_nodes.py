"""Nodes on one machine (accelerate_configs/nodes.py): network namespaces with an address, a hostname and
a hosts file each, joined by a bridge, with no route out. A launch across two of them trains as one machine
does; a node whose name resolves to a loopback address (the hostname trap) is refused in one line whose
advice then trains; the nodes go down leaving no namespace, hosts file or process. Skipped, with the
reason, where namespaces cannot be made (not root, not Linux, no iproute2). The launch of four processes
across two nodes and the nodes that share no disk are marked cluster: `make test-cluster` runs them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, user_env, weights
from test_train_ddp import AGREE, FROZEN_BN, UNTRACKED, max_difference, one_process, one_process_run  # noqa: F401

sys.path.insert(0, str(ROOT / "accelerate_configs"))
import nodes  # noqa: E402

WHY_NOT = nodes.why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no nodes here: {WHY_NOT}")
BIN = Path(sys.executable).parent


@pytest.fixture
def made(request):
    """Nodes made by the test, prefixes of its own (a user's nodes, and another suite's running beside, are left
    alone: the prefix ends with the pid): taken down whatever happened."""
    prefixes = []

    def make(count: int, prefix: str, **kwargs) -> str:
        prefix = f"{prefix}{os.getpid()}"
        prefixes.append(prefix)
        nodes.up(count, prefix=prefix, **kwargs)
        return prefix
    yield make
    for prefix in prefixes:
        nodes.down(prefix)


def accelerate_launch(rank: int) -> list[str]:
    """One process on this node, machine rank ``rank`` of two: the two-node config."""
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "2nodes_4gpu.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "node1"]


def torchrun(rank: int) -> list[str]:
    """Two processes on this node, of two nodes met through c10d's rendezvous on node1 (whose agent hosts it)."""
    return [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "node1:29400", "--rdzv-id", "nodes", "--node-rank", str(rank)]


def launch_on_both(prefix: str, out: Path, *extra, env_extra=None, launcher=accelerate_launch,
                   own_disk: Path | None = None, nodes_launched=(0, 1), rdzv_timeout=None) -> list[subprocess.Popen]:
    """train_ddp.py on node1 (machine rank 0) and node2 under ``launcher``, BatchNorm frozen (the agreement
    flags): started, not waited for. ``own_disk``: node2 has a disk of its own there (a tmpfs), as nodes that
    share no disk do. ``nodes_launched``: the machine ranks launched; ``rdzv_timeout``: the launcher's bound
    on its wait for the others (--rdzv_conf timeout=N)."""
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(out.parent / ".cache"), **(env_extra or {}))
    mount = ["sh", "-c", f'mount -t tmpfs node2-disk {own_disk} && exec "$@"', "sh"] if own_disk else []
    bound = ["--rdzv_conf", f"timeout={rdzv_timeout}"] if rdzv_timeout else []
    return [subprocess.Popen(nodes.command(rank + 1, [
        *mount * rank, *launcher(rank), *bound, FROZEN_BN, str(ROOT / "scripts" / "train_ddp.py"), *AGREE,
        *UNTRACKED, *extra, "--output-dir", str(out)], prefix=prefix), cwd=out.parent.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in nodes_launched]


def test_each_node_has_its_name_and_address_and_no_route_out(made):
    prefix = made(2, "mgcn")
    for k in (1, 2):
        said = subprocess.run(nodes.command(k, ["sh", "-c", "hostname; getent hosts node1 node2; ip -4 route"],
                                            prefix=prefix), capture_output=True, text=True, check=True).stdout
        assert said.split("\n") == [f"node{k}", f"{nodes.SUBNET}.1      node1", f"{nodes.SUBNET}.2      node2",
                                    f"{nodes.SUBNET}.0/24 dev eth0 proto kernel scope link src {nodes.SUBNET}.{k} ",
                                    ""], said  # one route: the nodes' own network, no default
    sleeper = subprocess.Popen(nodes.command(1, ["sleep", "600"], prefix=prefix))
    nodes.down(prefix)
    assert sleeper.wait(timeout=10) == -9 and nodes.names(prefix) == []
    assert not list(nodes.NETNS_ETC.glob(f"{prefix}-*"))


def test_a_node_whose_name_resolves_to_a_loopback_address_is_refused_and_the_advice_trains_as_one_machine(
        made, one_process, tmp_path):
    """Each node's own name at 127.0.1.1 in its hosts file, as Debian's installer writes it: gloo would give
    the other node that address (node 1 then failed in Accelerator(), node 2 waited until killed). Node 2,
    whose node 0 is elsewhere, is refused in one line naming GLOO_SOCKET_IFNAME, before its process group is
    made; node 1 ends too. With GLOO_SOCKET_IFNAME set to the nodes' interface on both, as the line says, the
    launch across the two network stacks, one process each, ends with the weights of one process at the same
    global batch."""
    prefix = made(2, "mgcl", loopback_name=True)
    out = tmp_path / "run"
    outputs = [node.communicate(timeout=200)[0] for node in launch_on_both(prefix, out, "--dist-timeout", "20")]
    assert ("error: this node's name, node2, resolves to 127.0.1.1, a loopback address (/etc/hosts), which gloo "
            "would give the other nodes: set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on, on "
            "every node (ip -brief addr lists them)") in outputs[1].splitlines(), outputs[1]
    assert f'File "{ROOT / "scripts"}' not in outputs[1], outputs[1]
    done = [node.communicate(timeout=240)[0]
            for node in launch_on_both(prefix, out, env_extra={"GLOO_SOCKET_IFNAME": "eth0"})]
    assert all("done: step 5" in output for output in done), "\n".join(done)
    assert max_difference(weights(out), one_process) < 1e-5


@pytest.mark.cluster  # make test-cluster: CI runs it after the suite
def test_two_nodes_of_two_processes_under_torchrun_checkpoint_and_resume_as_one_machine(made, one_process, tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2, c10d's rendezvous on node1: four processes, 16 images each, train
    to the weights of one process at the global batch of 64, with checkpoints holding all four processes' states;
    a new launch across the nodes resumed from step 2's checkpoint, into a new folder, ends with the same
    weights."""
    prefix = made(2, "mgcu")
    out, resumed = tmp_path / "runs" / "run", tmp_path / "runs" / "resumed"
    out.parent.mkdir()
    done = [node.communicate(timeout=300)[0] for node in launch_on_both(
        prefix, out, "--checkpoint-every", "2", "--keep-checkpoints", "5", launcher=torchrun)]
    assert "on 4 x cpu:0 (gloo), batch 64 (16 per device)" in done[0] and "done: step 5" in done[0], done[0]
    assert all("Traceback" not in output for output in done), "\n".join(done)
    assert max_difference(weights(out), one_process) < 1e-5
    step_2 = out / "checkpoints" / "step_00000002"
    assert {f"random_states_{rank}.pkl" for rank in range(4)} <= {path.name for path in step_2.iterdir()}
    again = [node.communicate(timeout=300)[0] for node in launch_on_both(
        prefix, resumed, "--resume", str(step_2), launcher=torchrun)]
    assert "resumed from" in again[0] and "done: step 5" in again[0], again[0]
    assert max_difference(weights(resumed), one_process) < 1e-5


@pytest.mark.cluster  # make test-cluster: CI runs it after the suite
def test_a_run_folder_that_the_nodes_do_not_share_is_refused_in_one_line(made, tmp_path):
    """Node 2 with a disk of its own where node 1 writes the run: its process would write its part of each
    checkpoint where node 1 never reads it. Every process ends before the first step, the line naming the
    folder, the node and the fix; node 2's disk holds nothing."""
    prefix = made(2, "mgcd")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    ended = launch_on_both(prefix, out, own_disk=out.parent)
    said = [node.communicate(timeout=200)[0] for node in ended]
    assert [node.returncode for node in ended] == [1, 1], "\n".join(said)
    line = (f"error: {out} is not on a disk that every node shares: process 1 on node2 does not see the .lock "
            f"that process 0 holds there, and each writes its part of a checkpoint; pass an --output-dir on a "
            f"shared filesystem")
    assert line in said[0].splitlines(), said[0]
    # no traceback through the project's code (the launcher on node2 reports its process's exit 1 in its own)
    assert all(f'File "{ROOT / "scripts"}' not in output and f'File "{ROOT / "common"}' not in output
               and "epoch 1/1" not in output for output in said), "\n".join(said)
    assert not out.exists()  # nothing written: the folder made for the lock is gone with it
