import fcntl
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

# `make test` runs the suite on 3 pytest-xdist workers (2 cores): much of a test's time is a process
# starting, importing torch or waiting for a timeout, which leaves a core idle. An OpenMP thread that
# waits for its sibling then sleeps instead of spinning: with the other worker's process on a core,
# the spinning took a tiny run 10x longer. One thread a process, as torchrun gives each of its
# processes: with 3 workers on 2 cores a second thread buys nothing, and a 3-epoch resnet20 run took
# 10 % more CPU with it on an idle machine (25.1 s against 22.6 s). Set before torch is imported
# (helpers imports it); every run the tests start inherits them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The files, and the tests of other files, that launch several processes at a launcher's default
# port: accelerate launch's 29500, the c10d rendezvous's 29400 (a restartable job without
# PET_STANDALONE; test_make_restart.py holds it). Two jobs at once would meet there (accelerate
# moves to another port when it finds 29500 taken, with a warning, but two that look at the same
# moment both take it), so these run one at a time, on one worker. A new test that launches
# several processes belongs here, or in OWN_PORTS. The other tests of these files (forked runs, fake
# launchers) run beside the others.
LAUNCHING_FILES = {"test_make_restart"}
LAUNCHING_TESTS = {
    # make bench's rows (the module fixture `report`: an accelerate launch of train_ddp.py)
    "test_benchmark": {"test_rows_launch_the_real_scripts_and_follow_the_protocol",
                       "test_checks_state_each_ratio_against_its_target",
                       "test_loader_check_compares_the_workers_path_with_torchvision_side_by_side",
                       "test_report_files_are_well_formed",
                       "test_each_flag_is_measured_against_the_launches_without_it_around_its_round"},
    # the jobs under accelerate launch, and the tests of their module fixtures (uninterrupted,
    # ddp_interrupted)
    "test_fault_tolerance": {"test_without_restarts_a_killed_worker_ends_the_job",
                             "test_ddp_stops_on_sigterm_to_the_launcher_and_resumes_bit_for_bit",
                             "test_ddp_stop_and_resume_by_hand",
                             "test_a_stalled_worker_fails_the_job_after_the_dist_timeout",
                             "test_the_launcher_passes_sigusr1_on_only_through_pet_signals_to_handle"},
    # on a GPU (skipped without one); its tests of gpu_check's plan and report run beside the others
    "test_gpu": {"test_every_script_learns_and_evaluate_reproduces_it", "test_stop_and_resume_is_bit_for_bit",
                 "test_all_gpus_match_one_gpu", "test_sync_bn_matches_one_gpu_and_plain_ddp_does_not",
                 "test_more_processes_than_gpus_is_refused_without_share_gpus",
                 "test_a_failure_in_one_process_ends_every_process",
                 "test_profile_traces_cuda_and_utilisation_is_read_per_process",
                 "test_fine_tunes_a_timm_model_at_224_px_through_the_workers"},
    "test_bad_input": {"test_a_bad_launch_gets_one_line", "test_a_port_already_in_use"},
    "test_copy_set": {"test_a_copied_script_trains_a_step_in_each_layout_the_readme_names"},
    "test_faults_signals": {"test_ctrl_c_on_a_two_process_job_stops_both_after_one_step_with_one_line"},
    "test_fine_tune": {"test_a_frozen_backbone_and_its_batchnorm_statistics_do_not_move_under_ddp",
                       "test_inputs_are_normalised_as_the_weights_expect_and_evaluate_needs_nothing_more",
                       "test_a_run_s_interpolation_is_carried_forward_by_pretrained_path"},
    # the accelerate launches, and the tests of their module fixture (the runs the others share are
    # forked: helpers.Processes, a free port each)
    "test_train_ddp": {"test_two_process_ddp_matches_one_process", "test_two_nodes_on_loopback_match_one_process",
                       "test_a_ddp_checkpoint_resumes_in_train_single_with_its_weights"},
    "test_train_fsdp": {"test_without_gpus_it_refuses_in_one_line_and_writes_nothing"},
    "test_faults_checkpoints": {"test_a_restartable_launch_that_shares_the_launchers_store_is_refused"},
}
# Launches on ports of their own only (a free port, torchrun --standalone, PET_STANDALONE=1): they
# run beside everything else. None: the whole file.
OWN_PORTS = {
    "test_ddp_lesson": None,  # torchrun --standalone
    "test_kubernetes": None,
    "test_nodes": None,
    "test_cluster_faults": None,  # the nodes' own network namespaces, as test_nodes
    "test_cluster_slurm": None,  # sbatch on nodes of its own; the reference run on a free port  # in network namespaces of their own: their ports are their own  # the pods' PET_MASTER_PORT is a free port; torchrun's wait --standalone
    # accelerate launch --num_processes 1 runs the script itself: no rendezvous, no port
    "test_fault_tolerance": {"test_killing_the_launcher_of_one_process_stops_the_training_process_with_a_checkpoint"},
    "test_fail_together": {"test_a_node_killed_during_start_up_ends_the_other_node_with_one_line"},  # a free port
    "test_faults_checkpoints": {"test_a_restart_continues_elsewhere_from_the_checkpoint_it_was_given",
                                "test_a_job_refused_at_its_start_is_refused_again_after_its_restart"},
}


# The files that read the session's full_run: on one worker, so that it trains once (a session
# fixture is made once per pytest-xdist worker that asks for it; 25 s of CPU each time).
FULL_RUN_FILES = {"test_train_single", "test_tracking", "test_train_dp", "test_wandb_flags"}


def _listed(nodeid: str, files: set, tests: dict) -> bool:
    file, _, test = nodeid.partition("::")
    stem = Path(file).stem
    return stem in files or test.partition("[")[0] in (tests.get(stem) or ())


def launches(nodeid: str) -> bool:
    """Whether the test launches at a default port: it runs with the others that do, one at a time."""
    return _listed(nodeid, LAUNCHING_FILES, LAUNCHING_TESTS)


def may_launch(nodeid: str) -> bool:
    return launches(nodeid) or _listed(nodeid, {f for f, t in OWN_PORTS.items() if t is None}, OWN_PORTS)


def launcher_of(command) -> str | None:
    """The launcher a subprocess command starts that starts several processes, if any."""
    parts = [str(part) for part in command] if isinstance(command, (list, tuple)) else str(command).split()
    name = Path(parts[0]).name if parts else ""
    if len(parts) > 2 and parts[1] == "-m":  # python -m MODULE
        return {"torch.distributed.run": "torchrun", "accelerate.commands.launch": "accelerate launch"}.get(parts[2])
    if name == "torchrun":
        return name
    if name == "accelerate" and "launch" in parts:
        return "accelerate launch"
    if name == "make" and "ddp" in parts:
        return "make ddp"
    return None


@contextmanager
def default_ports():
    """The launchers' default ports held by one test at a time on this machine, across suites: a second
    suite beside this one (another clone's, CI's) would launch its jobs there too, and two jobs meet at
    29500. A lock file every suite shares, taken for the test's setup, run and teardown."""
    with open(Path(tempfile.gettempdir()) / "multigpu-cifar-tests-default-ports.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test outside the lists above that starts a launcher (in its setup too), cold or forked from
    the zygote (helpers.execute), fails, saying where it belongs."""
    zygote = getattr(sys.modules.get("helpers"), "Zygote", None)
    popen, fork = subprocess.Popen.__init__, zygote and zygote.start

    def check(args) -> None:
        launcher = launcher_of(args)
        if launcher and not may_launch(item.nodeid):
            raise AssertionError(f"{item.nodeid} starts {launcher}: add it to LAUNCHING_TESTS (or, on ports of "
                                 f"its own only, OWN_PORTS) in tests/conftest.py")

    def guarded_popen(self, args, *rest, **kwargs):
        check(args)
        popen(self, args, *rest, **kwargs)

    def guarded_fork(self, command, *rest, **kwargs):
        check(command)
        return fork(self, command, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_popen
    if zygote:
        zygote.start = guarded_fork
    try:
        with default_ports() if launches(item.nodeid) else nullcontext():
            return (yield)
    finally:
        subprocess.Popen.__init__ = popen
        if zygote:
            zygote.start = fork


def pytest_collection_modifyitems(items):
    readers = {Path(str(item.fspath)).stem for item in items if "full_run" in getattr(item, "fixturenames", ())}
    if readers - FULL_RUN_FILES:
        raise pytest.UsageError(f"{', '.join(sorted(readers - FULL_RUN_FILES))} read full_run: add them to "
                                f"FULL_RUN_FILES in tests/conftest.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (make gpu-check runs them)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by file (a file's module fixtures run once), the launching tests together
    in one unit of work, and the readers of full_run in another."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if launches(nodeid):
                return "launching"
            file = nodeid.partition("::")[0]
            return "full_run" if Path(file).stem in FULL_RUN_FILES else file

    return Scheduler(config, log)


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """One uninterrupted 3-epoch train_single run, tracked offline, shared by the test files of
    FULL_RUN_FILES."""
    from helpers import TINY, run  # here, not at the top: pytest-xdist's controller, which runs no test, loads
    # this file too, and helpers imports torch (6 s of CPU)

    out = tmp_path_factory.mktemp("full") / "run"
    done = run("train_single.py", *TINY, "--log-every", 8, "--output-dir", out)
    return out, done
