"""Faults between nodes (accelerate_configs/nodes.py: two network namespaces, one process each under
`accelerate launch`, BatchNorm frozen, the agreement flags): a node lost, the link cut mid-step and
mid-checkpoint, the rendezvous host unreachable at start, a slow link. Each fault ends every process on
every node, each saying at most one line of its own (the launchers report their processes' exits in their
own words), and the run then resumes across the nodes to the weights of one process at the same global
batch: nothing is lost. `make test-cluster` runs them (the marker `cluster`), beside the real SLURM."""

import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, weights
from test_nodes import WHY_NOT, launch_on_both, made, nodes  # noqa: F401
from test_train_ddp import max_difference, one_process, one_process_run  # noqa: F401

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(WHY_NOT is not None, reason=f"no nodes here: {WHY_NOT}")]
ABORTS = ("terminate called", "Fatal Python error", "core dumped")
RESUMABLE = ["--checkpoint-every", "2", "--keep-checkpoints", "5"]


def wait_for(path: Path, launched: list[subprocess.Popen], timeout=180) -> float:
    """The moment ``path`` exists, while every node's launcher runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and all(node.poll() is None for node in launched), path
        time.sleep(0.05)
    return time.monotonic()


def ends(launched: list[subprocess.Popen], since: float, timeout=120) -> tuple[list[str], float]:
    """Every node's output, once every launcher has ended, and the seconds from ``since`` to the last end."""
    said = [node.communicate(timeout=timeout)[0] for node in launched]
    return said, time.monotonic() - since


def own_lines(output: str) -> list[str]:
    """The lines the training processes said of the fault: the project's error and warning lines."""
    return re.findall(r"(?:^|\r)((?:error|warning): [^\r\n]*)", output, re.MULTILINE)


def assert_no_traceback_of_ours(said: list[str]) -> None:
    for output in said:
        assert f'File "{ROOT / "scripts"}' not in output and f'File "{ROOT / "common"}' not in output, output
        assert not any(sign in output for sign in ABORTS), output


def resumes_as_one_machine(prefix: str, out: Path, one_process: dict, step: int) -> None:
    """A new launch on both nodes with --resume continues from step ``step``'s checkpoint to the weights of
    one process."""
    done = [node.communicate(timeout=240)[0] for node in launch_on_both(prefix, out, *RESUMABLE, "--resume")]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in done[0], done[0]
    assert "done: step 5" in done[0], done[0]
    assert max_difference(weights(out), one_process) < 1e-5


def test_a_node_lost_ends_the_other_in_one_line_and_the_run_resumes(made, one_process, tmp_path):
    """Every process of node 2 (its launcher, its worker) SIGKILLed after step 2's checkpoint: process 0 on
    node 1 loses it in a collective and says so in one line, exit 1, within seconds; its launcher reports it."""
    prefix = made(2, "mgck")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    launched = launch_on_both(prefix, out, *RESUMABLE, env_extra={"PROBE_STEP_S": "1"})
    wait_for(out / "checkpoints" / "step_00000002" / "checkpoint.json", launched)
    for pid in subprocess.run(["ip", "netns", "pids", f"{prefix}-node2"], capture_output=True, text=True).stdout.split():
        subprocess.run(["kill", "-9", pid])
    said, seconds = ends(launched, time.monotonic())
    assert launched[1].returncode == -9 and launched[0].returncode == 1, said
    assert [re.sub(r"\(.*\)", "(...)", line) for line in own_lines(said[0])] == [
        "error: process 0 lost another process of the job in a collective (...): that process ended first; its "
        "own output or the launcher's report says why"], said[0]
    assert seconds < 15, (seconds, said[0])
    assert_no_traceback_of_ours(said)
    print(f"node lost: node 1 ended {seconds:.1f} s after the kill")
    resumes_as_one_machine(prefix, out, one_process, 2)


def cut(prefix: str, node: int, state: str = "down") -> None:
    """Node ``node``'s link to the others down (a partition: no packet passes, no connection is reset) or up."""
    subprocess.run(nodes.command(node, ["ip", "link", "set", "eth0", state], prefix=prefix), check=True)


def test_the_link_cut_mid_step_ends_both_nodes_in_one_line_each_and_the_run_resumes(made, one_process, tmp_path):
    """Node 2's link down after step 2's checkpoint, both processes in a step: nothing fails in a collective
    (gloo would wait --dist-timeout). Node 2's process loses the store it meets through (on node 1), node 1's
    hears node 2's heartbeat stop (its last beat, half a second old at most, names the step); each says so in one
    line and exits 1, long before --dist-timeout (40 s)."""
    prefix = made(2, "mgcc")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    launched = launch_on_both(prefix, out, *RESUMABLE, "--dist-timeout", "40", env_extra={"PROBE_STEP_S": "1"})
    wait_for(out / "checkpoints" / "step_00000002" / "checkpoint.json", launched)
    cut(prefix, 2)
    said, seconds = ends(launched, time.monotonic())
    print(f"link cut mid-step: both nodes ended within {seconds:.1f} s;", *(own_lines(output) for output in said))
    assert [node.returncode for node in launched] == [1, 1], said
    assert [len(own_lines(output)) for output in said] == [1, 1], said
    assert re.fullmatch(r"error: process 0: process 1 on node2 has not answered for 10 s, after step [1-4]: it is "
                        r"stopped \(SIGSTOP, a frozen node\) or cut off; the job ends now, not at --dist-timeout",
                        own_lines(said[0])[0]), said[0]
    assert own_lines(said[1])[0].startswith("error: process 1 lost the store through which the job's processes "
                                            "meet"), said[1]
    assert seconds < 30, (seconds, said)
    assert_no_traceback_of_ours(said)
    cut(prefix, 2, "up")
    resumes_as_one_machine(prefix, out, one_process, 2)


def test_the_link_cut_mid_checkpoint_keeps_the_one_before_and_the_run_resumes(made, one_process, tmp_path):
    """Node 2's link down while step 4's checkpoint is being written (node 2's process enters each save 3 s
    late): every process ends in one line at most, the half-written checkpoint is removed, step 2's is intact
    and the run resumes from it."""
    prefix = made(2, "mgcz")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    launched = launch_on_both(prefix, out, *RESUMABLE, "--dist-timeout", "40", env_extra={"PROBE_SAVE_S": "3"})
    wait_for(out / "checkpoints" / ".tmp-step_00000004", launched)
    cut(prefix, 2)
    said, seconds = ends(launched, time.monotonic())
    print(f"link cut mid-checkpoint: both nodes ended within {seconds:.1f} s;", *map(own_lines, said))
    assert [node.returncode for node in launched] == [1, 1], said
    assert [len(own_lines(output)) for output in said] == [1, 1], said
    assert seconds < 30, (seconds, said)
    assert_no_traceback_of_ours(said)
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["step_00000002"]
    cut(prefix, 2, "up")
    resumes_as_one_machine(prefix, out, one_process, 2)


def test_a_rendezvous_host_that_never_comes_ends_the_node_waiting_for_it_at_the_bound_it_was_given(made, tmp_path):
    """Node 2 launched, node 1 never: torch's launcher on node 2 waits for the rendezvous (node1:29500) before any
    process of ours starts, 600 s by default (static rendezvous). --rdzv_conf timeout=20, as docs/usage.md says,
    bounds it: the launcher exits 1 with torch's traceback, whose last line names the host it could not reach;
    nothing is left running on node 2 and nothing is written."""
    prefix = made(2, "mgcr")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    start = time.monotonic()
    [alone] = launch_on_both(prefix, out, nodes_launched=(1,), rdzv_timeout=20)
    said, seconds = ends([alone], start, timeout=180)
    print(f"rendezvous host unreachable: node 2's launcher ended after {seconds:.1f} s")
    assert alone.returncode == 1, said[0]
    assert said[0].strip().splitlines()[-1] == ("torch.distributed.DistNetworkError: The client socket has timed out "
                                                "after 20000ms while trying to connect to (node1, 29500)."), said[0]
    assert seconds < 120, seconds
    assert subprocess.run(["ip", "netns", "pids", f"{prefix}-node2"], capture_output=True, text=True).stdout == ""
    assert not out.exists()


def test_a_slow_link_costs_time_and_nothing_else(made, one_process, tmp_path):
    """Both nodes' links held to 10 Mbit/s (tc's token bucket: the kernels here have no netem, so no delay or
    loss of packets of its own): the run ends as one machine's, bit for bit; its cost against the same launch on
    the free link is printed."""
    prefix = made(2, "mgcw")
    seconds = []
    for name, limited in (("free", False), ("slow", True)):
        if limited:
            for node in (1, 2):
                subprocess.run(nodes.command(node, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                                                    "10mbit", "burst", "32kbit", "latency", "400ms"], prefix=prefix),
                               check=True)
        out = tmp_path / "runs" / name
        out.parent.mkdir(exist_ok=True)
        start = time.monotonic()
        done, took = ends(launch_on_both(prefix, out), start, timeout=300)
        seconds.append(took)
        assert "done: step 5" in done[0], done[0]
        assert max_difference(weights(out), one_process) < 1e-5
    print(f"slow link (10 Mbit/s): {seconds[1]:.1f} s against {seconds[0]:.1f} s on the free link")
