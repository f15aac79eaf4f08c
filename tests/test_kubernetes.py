"""Kubernetes (accelerate_configs/kubernetes/): the manifests are what Kubeflow Trainer v2 reads,
and the pods they make train together, survive a restart and a preemption, and continue by
themselves.

No cluster here (`kubectl --dry-run=client` still asks a server), so the manifests are loaded into
the official API models (kubeflow-trainer-api) and every key is checked against the models' fields,
which ignore unknown ones. The pods are simulated on this machine: two torchrun agents with exactly
the environment the Torch plugin and the runtime give the two pods of a 2-node TrainJob (PET_* with
the first pod's address on the loopback, the runtime's env with the downward API's labels filled
in), running the TrainJob's command and args as Kubernetes expands them, tiny flags appended (the
last value of a flag wins). A JobSet restart is both pods started again: new processes, the same
JobSet uid. The uninterrupted reference runs the same script and flags on 2 processes forked as
torchrun starts them. What a worker's exit status is, torchrun does not say after passing a signal
on: a `sitecustomize` on PYTHONPATH (the test's only addition) records each worker's `sys.exit` code.
Not run here: the image build (no base image can be pulled) and a real cluster.
"""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from accelerate import Accelerator
from helpers import ROOT, Processes, assert_same_weights, bad_ends, free_port, user_env
from kubeflow_trainer_api import models
from pydantic import BaseModel

from common.errors import UserError
from common.run.checkpoints import TrainProgress, save_checkpoint
from common.run.folder import lock_run_and_find_resume
from common.run.lock import JOB_FILE, JOB_ID_VARIABLE, LOCK_FILE, RunLock

KUBE = ROOT / "accelerate_configs" / "kubernetes"
BIN = Path(sys.executable).parent
MODELS = {"TrainJob": models.TrainerV1alpha1TrainJob, "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
          "PersistentVolumeClaim": models.IoK8sApiCoreV1PersistentVolumeClaim}
API_VERSIONS = {"TrainJob": "trainer.kubeflow.org/v1alpha1", "TrainingRuntime": "trainer.kubeflow.org/v1alpha1",
                "PersistentVolumeClaim": "v1"}
# 6 steps an epoch, 12 in all, a checkpoint every 4 steps: the runs below are stopped after steps 4
# and 8, inside epochs 1 and 2.
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "192", "--synthetic-test-size", "64", "--model",
        "resnet20", "--batch-size", "32", "--reference-batch-size", "64", "--epochs", "2", "--checkpoint-every", "4",
        "--keep-checkpoints", "10", "--report-to", "none"]
STOPPED = 75  # common.parallel.step_guard.STOPPED_EXIT_CODE
# Each worker's exit code, in a file named after its rank and pid: torchrun reports none after it has
# passed a signal on.
EXIT_RECORDER = """import os, sys
if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:  # a worker that torchrun started
    _exit = sys.exit

    def _recorded(code=None):
        path = os.path.join(os.environ["EXIT_RECORDS"], f"rank{os.environ['RANK']}-pid{os.getpid()}")
        with open(path, "w") as record:
            record.write(str(0 if code is None else code))
        _exit(code)

    sys.exit = _recorded
"""


def manifest(name: str) -> dict:
    return yaml.safe_load((KUBE / name).read_text())


def unknown_fields(data, obj, path: str) -> list[str]:
    """The keys of ``data`` (a manifest as YAML gives it) that the model ``obj`` parsed from it has no
    field for: the models keep no unknown key, so a misspelt one is simply dropped."""
    if isinstance(obj, BaseModel) and hasattr(obj, "actual_instance"):
        return []  # a oneOf wrapper around a scalar (a resource quantity): no keys
    if isinstance(obj, BaseModel):
        fields = {field.alias or name: name for name, field in type(obj).model_fields.items()}
        return [problem for key, value in data.items()
                for problem in ([f"{path}.{key}"] if key not in fields
                                else unknown_fields(value, getattr(obj, fields[key]), f"{path}.{key}"))]
    if isinstance(obj, list):
        return [problem for i, (item, parsed) in enumerate(zip(data, obj, strict=True))
                for problem in unknown_fields(item, parsed, f"{path}[{i}]")]
    if isinstance(obj, dict):  # free keys (labels, resource names): their values may be models
        return [problem for key in data for problem in unknown_fields(data[key], obj[key], f"{path}.{key}")]
    return []


def check(name: str, document: dict | None = None) -> BaseModel:
    """The manifest ``name`` (or ``document`` in its place) parsed by the API model of its kind, with
    every key known to the model."""
    document = document or manifest(name)
    assert document["apiVersion"] == API_VERSIONS[document["kind"]], name
    parsed = MODELS[document["kind"]].from_dict(document)
    problems = unknown_fields(document, parsed, document["kind"])
    assert not problems, f"{name}: fields the API does not have: {problems}"
    return parsed


def node_container(runtime: dict) -> dict:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node"  # the container the Trainer fills from the TrainJob
    return container


def pod_spec(runtime: dict) -> dict:
    return runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def runtime_env() -> dict:
    return {item["name"]: item for item in node_container(manifest("runtime.yaml"))["env"]}


# ------------------------------------------------------------------------------------ manifests


@pytest.mark.parametrize("name", sorted(p.name for p in KUBE.glob("*.yaml")))
def test_each_manifest_loads_into_the_official_api_models(name):
    check(name)


def test_a_misspelt_field_fails_the_check():
    """Negative control: the models alone take each of these misspellings without a word."""
    for name, misspell in [("train_ddp.yaml", lambda d: d["spec"]["trainer"].update(numNode=2)),
                           ("runtime.yaml", lambda d: pod_spec(d).update(terminationGracePeriodSecond=180)),
                           ("runtime.yaml", lambda d: node_container(d)["env"][0].update(valueform={}))]:
        document = manifest(name)
        misspell(document)
        MODELS[document["kind"]].from_dict(document)  # accepted by the model
        with pytest.raises(AssertionError, match="fields the API does not have"):
            check(name, document)


def test_the_jobs_name_the_runtime_and_the_runtime_restarts_them():
    runtime, volume = check("runtime.yaml"), manifest("runs_volume.yaml")
    policy = runtime.spec.template.spec.failure_policy
    assert policy.max_restarts > 0 and [rule.action for rule in policy.rules] == ["RestartJobSetAndIgnoreMaxRestarts"]
    (replicated,) = runtime.spec.template.spec.replicated_jobs
    # the Trainer's webhook: the trainer's replicated Job has one replica and a container "node"
    assert replicated.template.metadata.labels["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert replicated.replicas == 1 and [c.name for c in replicated.template.spec.template.spec.containers] == ["node"]
    job = replicated.template.spec
    assert job.backoff_limit == 0 and job.template.spec.restart_policy == "Never"
    # The rule's reason is what the Job's podFailurePolicy gives an evicted pod.
    assert policy.rules[0].on_job_failure_reasons == ["PodFailurePolicy"]
    assert [c.type for c in job.pod_failure_policy.rules[0].on_pod_conditions] == ["DisruptionTarget"]
    claims = [v.persistent_volume_claim.claim_name for v in job.template.spec.volumes if v.persistent_volume_claim]
    assert claims == [volume["metadata"]["name"]] and volume["spec"]["accessModes"] == ["ReadWriteMany"]
    env = runtime_env()
    uid = "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"  # the same after a restart, new for a new job
    assert env[JOB_ID_VARIABLE]["valueFrom"]["fieldRef"]["fieldPath"] == uid
    # torchrun's wait for its workers after passing SIGTERM on ends before the pod's grace period
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"]) < job.template.spec.termination_grace_period_seconds
    for name, script in [("train_ddp.yaml", "scripts/train_ddp.py"), ("train_amp_bf16.yaml", "scripts/train_amp.py")]:
        trainjob = check(name)
        assert trainjob.spec.runtime_ref.kind == "TrainingRuntime"
        assert trainjob.spec.runtime_ref.name == runtime.metadata.name
        trainer = trainjob.spec.trainer
        assert trainer.command == ["torchrun", script] and trainer.num_nodes == 2
        assert trainer.image == job.template.spec.containers[0].image
        # one process per GPU; the webhook rejects PET_* in trainer.env
        assert trainer.num_proc_per_node == trainer.resources_per_node.limits["nvidia.com/gpu"].actual_instance
        assert not any(e.name.startswith("PET_") for e in trainer.env or [])
    assert "--mixed-precision" in (amp := check("train_amp_bf16.yaml").spec.trainer.args)
    assert amp[amp.index("--mixed-precision") + 1] == "bf16"


# ------------------------------------------------------------------------------- job identity


class MainProcess:
    """What lock_run_and_find_resume asks of the accelerator of a one-process job."""
    is_main_process = True


@pytest.fixture
def taken(tmp_path, monkeypatch):
    """A run folder with a real checkpoint, taken by the job TRAINING_JOB_ID=first, whose lock a
    pod on another node left when it was killed; nothing in the environment counts a restart."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 2))
    TrainProgress(accelerator)  # progress.json in every checkpoint
    save_checkpoint(accelerator, out, 4, keep=2)
    (out / "config.json").write_text("{}")
    (out / JOB_FILE).write_text("job first\n")
    (out / LOCK_FILE).write_text(json.dumps({"host": "train-ddp-node-0-0", "pid": 7, "since": "then",
                                             "job": "job first"}))
    yield out, lambda: lock_run_and_find_resume(MainProcess(), str(out), None, "train_ddp.py")
    RunLock._release_all()


def test_a_job_started_again_with_its_id_continues_in_its_folder(taken, monkeypatch, capsys):
    """A JobSet restart, or Kueue's resume: new pods on other hosts, no restart count, the same id."""
    out, resolve = taken
    monkeypatch.setenv(JOB_ID_VARIABLE, "first")
    assert resolve() == (out, out / "checkpoints" / "step_00000004")
    assert capsys.readouterr().err == ""  # its own lock, left by the killed pod: taken over quietly
    assert (out / JOB_FILE).read_text() == "job first\n"


@pytest.mark.parametrize("job", ["second", "first"], ids=["another job", "a folder this job never took"])
def test_another_job_in_that_folder_is_refused(taken, monkeypatch, job):
    """Another TrainJob (or one of the same name made again: a new uid) gets the checks of a new
    start, and so does this job in a folder it never took (refused at its first start, say)."""
    out, resolve = taken
    monkeypatch.setenv(JOB_ID_VARIABLE, job)
    if job == "first":
        (out / JOB_FILE).unlink()
    with pytest.raises(UserError) as error:
        resolve()
    assert error.value.message == (f"--output-dir {out} already holds a run: add --resume to continue it, or "
                                   f"choose another --output-dir")
    # followed as printed: with --resume the job continues the run in that folder
    assert lock_run_and_find_resume(MainProcess(), str(out), "latest", "train_ddp.py") == (
        out, out / "checkpoints" / "step_00000004")


def test_a_job_its_scheduler_names_needs_an_output_dir(monkeypatch, tmp_path):
    """Without one, each start would train from step 0 in a new folder."""
    monkeypatch.setenv(JOB_ID_VARIABLE, "first")
    with pytest.raises(UserError) as error:
        lock_run_and_find_resume(MainProcess(), None, None, "train_ddp.py")
    assert error.value.message == ("a restartable launch (--max_restarts, TRAINING_JOB_ID) needs --output-dir, so "
                                   "that a restarted worker finds the run's checkpoints: add --output-dir runs/NAME")
    # followed as printed: the job starts in that folder, and a restart of it finds it again
    monkeypatch.chdir(tmp_path)
    given = error.value.message.rpartition("add --output-dir ")[2]
    assert lock_run_and_find_resume(MainProcess(), given, None, "train_ddp.py") == (Path(given), None)
    assert (tmp_path / given / JOB_FILE).read_text() == "job first\n"  # what a restart of the job finds


# ------------------------------------------------------------------------------------- the pods


class Job:
    """A 2-node TrainJob of train_ddp.yaml in a workspace (the image's WORKDIR: scripts/, runs/),
    its pods simulated as torchrun agents on this machine."""

    def __init__(self, workspace: Path, name: str):
        self.workspace, self.name, self.uid = workspace, name, str(uuid.uuid4())
        self.records = workspace / "exits" / name
        self.records.mkdir(parents=True)
        self.attempt = 0

    def pod_env(self, rank: int, port: int) -> dict:
        """The pod's environment: the runtime's env, the downward API's labels in it, and the Torch
        plugin's PET_* (on a cluster PET_MASTER_ADDR is train-ddp-node-0-0.train-ddp, the port 29500)."""
        labels = {"jobset.sigs.k8s.io/jobset-uid": self.uid, "jobset.sigs.k8s.io/jobset-name": self.name}
        env = {name: value for name, value in user_env().items()  # nothing of a launcher around this test
               if not name.startswith(("PET_", "TORCHELASTIC_", "SLURM_", JOB_ID_VARIABLE))}
        env.update(CIFAR_CACHE_DIR=str(self.workspace / ".cache"), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(self.workspace.parent / "probe"), EXIT_RECORDS=str(self.records))
        trainer = manifest("train_ddp.yaml")["spec"]["trainer"]
        for item in node_container(manifest("runtime.yaml"))["env"] + trainer.get("env", []):
            source = item.get("valueFrom", {})
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in source:
                (label,) = re.fullmatch(r"metadata\.labels\['(.+)'\]", source["fieldRef"]["fieldPath"]).groups()
                env[item["name"]] = labels[label]
            else:
                assert source["secretKeyRef"]["optional"], item  # no such Secret here
        return {**env, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}

    def command(self, env: dict) -> list[str]:
        """The TrainJob's command and args, $(VAR) expanded from the pod's env as the kubelet does."""
        trainer = manifest("train_ddp.yaml")["spec"]["trainer"]
        expand = lambda arg: re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)  # noqa: E731
        command = [expand(arg) for arg in trainer["command"] + trainer["args"]]
        return [str(BIN / command[0]), *command[1:], *TINY]

    def start(self) -> list[subprocess.Popen]:
        """Both pods, started together as the JobSet creates them."""
        self.attempt += 1
        port, pods = free_port(), []
        for rank in (0, 1):
            env = self.pod_env(rank, port)
            log = open(self.workspace / f"{self.name}-{self.attempt}-pod{rank}.log", "w")
            pods.append(subprocess.Popen(self.command(env), cwd=self.workspace, env=env, stdout=log,
                                         stderr=subprocess.STDOUT))
            log.close()
        return pods

    def output(self, attempt: int, rank: int) -> str:
        return (self.workspace / f"{self.name}-{attempt}-pod{rank}.log").read_text()

    @property
    def folder(self) -> Path:
        return self.workspace / "runs" / self.name

    def exits(self) -> dict[str, int]:
        """The workers' exit codes recorded so far, by rank and pid; cleared."""
        found = {p.name: int(p.read_text()) for p in self.records.iterdir()}
        for p in self.records.iterdir():
            p.unlink()
        return found


def wait_for(path: Path, pods, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in pods), "a pod ended before it wrote " + str(path)
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def finish(pods, timeout=180) -> list[int]:
    """The pods' exit codes; those still running after ``timeout`` are killed."""
    try:
        return [p.wait(timeout) for p in pods]
    except subprocess.TimeoutExpired:
        for p in pods:
            if p.poll() is None:
                lose_node(p)
        raise


def lose_node(pod: subprocess.Popen) -> None:
    """SIGKILL to every process of the pod at once, as when its node is lost: torchrun starts its
    workers in sessions of their own, and a worker whose agent dies first would stop with a
    checkpoint (PR_SET_PDEATHSIG), so the workers go first."""
    agent = psutil.Process(pod.pid)
    for process in [*agent.children(recursive=True), agent]:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
            process.send_signal(signal.SIGKILL)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def clean(output: str) -> bool:
    """No traceback or C++ abort from a training process. torchrun's own log lines are left out: a
    pod's agent whose peer agent, which holds the store, has already exited logs "Error waiting on
    exit barrier" with a traceback after its workers all exited 0 (seen in 1 of 4 runs)."""
    ours = "\n".join(line for line in output.splitlines()
                      if not re.match(r"[WEI]\d{4} [\d:.]+ \d+ torch/distributed/elastic/", line))
    return "Traceback" not in ours and "terminate called" not in ours


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The image's WORKDIR: the project's scripts/ (common/ is installed), runs/ for the volume."""
    folder = tmp_path_factory.mktemp("k8s") / "workspace"
    folder.mkdir()
    (folder / "scripts").symlink_to(ROOT / "scripts")
    probe = folder.parent / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(EXIT_RECORDER)
    return folder


@pytest.fixture(scope="module")
def reference(workspace):
    """The TrainJob's run uninterrupted, its 2 processes forked as torchrun starts them on one node
    (helpers.Processes: no imports to pay; the launch is what the interrupted job tests), started first
    and run beside the interrupted job, whose pods leave the cores idle while they start, fail and
    stop; called, its run folder once it has ended."""
    job = Job(workspace, "reference")
    command = job.command(job.pod_env(0, 0))
    processes = Processes(workspace / command[1], *command[2:], cwd=workspace)  # rank0.out ... in the workspace

    def ended() -> Path:
        assert processes.wait(timeout=180) == [0, 0], processes.output()
        assert all(clean(processes.stderr(rank)) for rank in (0, 1)), processes.output()
        return job.folder

    yield ended
    processes.kill()  # a test that failed before the reference ended


@pytest.fixture(scope="module")
def interrupted(workspace, reference):
    """The TrainJob with a pod killed after the step-4 checkpoint, restarted, preempted (SIGTERM to
    both pods) after the step-8 checkpoint, and restarted again to its end."""
    job = Job(workspace, "train-ddp")
    found = {}
    pods = job.start()
    wait_for(job.folder / "checkpoints" / "step_00000004", pods)
    lose_node(pods[1])
    killed = time.perf_counter()
    found["crash"] = finish(pods, timeout=120), time.perf_counter() - killed, job.exits()

    pods = job.start()  # the JobSet restart: new pods, the same JobSet uid
    wait_for(job.folder / "checkpoints" / "step_00000008", pods)
    sent = time.perf_counter()
    for pod in pods:
        pod.send_signal(signal.SIGTERM)  # to PID 1 of each container: torchrun
    codes = finish(pods, timeout=300)
    found["preempted"] = codes, time.perf_counter() - sent, job.exits(), listing(job.folder)

    pods = job.start()
    found["finished"] = finish(pods), None, job.exits()
    found["outputs"] = {attempt: [job.output(attempt, rank) for rank in (0, 1)] for attempt in (1, 2, 3)}
    return job, found


def test_a_lost_node_fails_the_other_pod_at_once(interrupted):
    """The other pod's worker meets the closed connection in its next all-reduce and says so in one
    line, with gloo's words (common.parallel.failures), its torchrun with exit 1: the Job fails and the JobSet
    restarts both pods, instead of waiting out --dist-timeout."""
    _, found = interrupted
    codes, seconds, exits = found["crash"]
    survivor = found["outputs"][1][0]
    print(f"\na node lost: the other pod ended {seconds:.1f} s later")
    assert codes == [1, -signal.SIGKILL] and seconds < 60, survivor[-3000:]
    lines = re.findall(r"error: .*", survivor)
    assert len(lines) == 1 and re.match(r"error: process 0 lost another process of the job in a collective "
                                        r"\(.*Connection (closed|reset) by peer", lines[0]), survivor[-3000:]
    assert re.search(r"exitcode\s*: 1 ", survivor) and bad_ends(survivor) == [], survivor[-3000:]
    assert exits == {}  # neither worker reached sys.exit: one killed, one ended (os._exit) in the all-reduce


def test_the_restarted_job_continues_by_itself_and_is_preempted_with_a_checkpoint(interrupted):
    job, found = interrupted
    restarted = found["outputs"][2]
    assert "resumed from runs/train-ddp/checkpoints/step_00000004" in restarted[0], restarted[0][-3000:]
    codes, seconds, exits, listed = found["preempted"]
    wait = int(runtime_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])  # below the grace period
    print(f"\nSIGTERM to both pods to the end of both: {seconds:.1f} s (torchrun waits {wait} s)")
    # torchrun exits 1 after passing a signal on (torch's SignalException); its workers exit 75
    assert codes == [1, 1] and seconds < wait, restarted
    assert sorted(exits.values()) == [STOPPED, STOPPED] and len(exits) == 2, exits
    (stop,) = map(int, re.findall(r"stopped by SIGTERM after step (\d+)", restarted[0]))
    assert 8 <= stop < 12 and f"checkpoints/step_{stop:08d}" in listed and "model.safetensors" not in listed
    assert f"resumed from runs/train-ddp/checkpoints/step_{stop:08d}" in found["outputs"][3][0]
    for output in restarted:  # the only traceback is the launcher's own, one per agent
        assert output.count("Traceback") == output.count("SignalException: Process") == 1, output[-3000:]
        assert "terminate called" not in output


def test_the_job_started_again_ends_at_the_weights_of_an_uninterrupted_run(interrupted, reference):
    job, found = interrupted
    codes, _, exits = found["finished"]
    outputs = found["outputs"][3]
    assert codes == [0, 0] and sorted(exits.values()) == [0, 0] and all(map(clean, outputs)), outputs
    assert "--resume" not in job.command(job.pod_env(0, 1))  # by itself
    assert_same_weights(job.folder, reference())
    records = [json.loads(line) for line in (job.folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 6), (2, 12)]  # one run, one record
