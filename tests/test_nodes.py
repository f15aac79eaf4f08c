"""Nodes on one machine (accelerate_configs/nodes.py): network namespaces with an address, a hostname and
a hosts file each, joined by a bridge, with no route out. A launch across two of them trains as one machine
does; a node whose name resolves to a loopback address (the hostname trap) is refused in one line whose
advice then trains; the nodes go down leaving no namespace, hosts file or process. Skipped, with the
reason, where namespaces cannot be made (not root, not Linux, no iproute2).
"""

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
    """Nodes made by the test, prefixes of its own (a user's nodes are left alone): taken down whatever
    happened."""
    prefixes = []

    def make(count: int, prefix: str, **kwargs) -> str:
        prefixes.append(prefix)
        nodes.up(count, prefix=prefix, **kwargs)
        return prefix
    yield make
    for prefix in prefixes:
        nodes.down(prefix)


def launch_on_both(prefix: str, out: Path, *extra, env_extra=None, timeout=240) -> list[subprocess.Popen]:
    """`accelerate launch` of train_ddp.py with the two-node config on node1 (machine rank 0) and node2, one
    process each, BatchNorm frozen (the agreement flags): started, not waited for."""
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(out.parent / ".cache"), **(env_extra or {}))
    return [subprocess.Popen(nodes.command(rank + 1, [
        str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "2nodes_4gpu.yaml"),
        "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "node1",
        FROZEN_BN, str(ROOT / "scripts" / "train_ddp.py"), *AGREE, *UNTRACKED, *extra, "--output-dir", str(out)],
        prefix=prefix), cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]


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
