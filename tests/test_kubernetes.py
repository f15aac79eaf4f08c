"""Kubernetes (accelerate_configs/kubernetes/, Dockerfile): the manifests are what Kubeflow Trainer
v2.3.0 and JobSet v0.12.0 accept, name only what their controllers set, and the pods they make train
together, stop with a checkpoint, restart without counting a stop against maxRestarts (a crash
counts), and continue by themselves.

No cluster here (`kubectl --dry-run=client` still asks a server), so the manifests are checked
against the schemas of those versions, kept in tests/k8s_api/ (README.md: where each comes from):
the CRDs the API server validates with, the OpenAPI definitions of the Kubernetes types with their
enums, and the names the controllers set (labels, Job failure reasons, pod conditions, Trainer's
ancestor and container); they also load into the official API models (kubeflow-trainer-api), which
check key names only. The pods are simulated on this machine: two torchrun agents, each run by the
TrainJob's command (torchrun_pod.py) with exactly the environment the Torch plugin, the runtime and
the image give the two pods of a 2-node TrainJob (PET_* with the first pod's address on the loopback,
the downward API's labels filled in), tiny flags appended (the last value of a flag wins). They
crash, are evicted one at a time, are suspended together and finish; a JobSet restart is both pods
started again (new processes, the same JobSet uid). Their exit statuses, and the DisruptionTarget
condition an eviction gives a pod, drive a model of the Job and JobSet controllers' rules
(tests/k8s_controllers.py) in every order the Job controller may see the pods fail. The
uninterrupted reference runs the same script and flags on 2 processes forked as torchrun starts
them. Each worker's own exit status is recorded by a `sitecustomize` on PYTHONPATH (the test's only
addition). Not run here: the image build (no Docker engine, no registry) and a real cluster.
"""

import contextlib
import copy
import importlib.util
import itertools
import json
import os
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
from helpers import ELASTIC_LOG, ROOT, Processes, assert_same_weights, bad_ends, free_port, user_env
from k8s_controllers import Pod, outcome
from k8s_schema import crd, downward_api_paths, jobset_spec, load, openapi
from kubeflow_trainer_api import models
from pydantic import BaseModel

from common.errors import UserError
from common.parallel.step_guard import STOP_RECORDS_VARIABLE, STOPPED_EXIT_CODE
from common.run.checkpoints import TrainProgress, save_checkpoint
from common.run.folder import lock_run_and_find_resume
from common.run.lock import JOB_FILE, JOB_ID_VARIABLE, LOCK_FILE, RunLock

KUBE = ROOT / "accelerate_configs" / "kubernetes"
BIN = Path(sys.executable).parent
MODELS = {"TrainJob": models.TrainerV1alpha1TrainJob, "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
          "PersistentVolumeClaim": models.IoK8sApiCoreV1PersistentVolumeClaim}
API_VERSIONS = {"TrainJob": "trainer.kubeflow.org/v1alpha1", "TrainingRuntime": "trainer.kubeflow.org/v1alpha1",
                "PersistentVolumeClaim": "v1"}
# 8 steps an epoch, 16 in all, a checkpoint every 2: the job below crashes after step 2, is
# stopped three times after a checkpoint newer than the one it resumed from, and finishes.
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64", "--model",
        "resnet20", "--batch-size", "32", "--reference-batch-size", "64", "--epochs", "2", "--checkpoint-every", "2",
        "--keep-checkpoints", "20", "--report-to", "none"]
STOPPED = STOPPED_EXIT_CODE
POD_ENTRY = KUBE / "torchrun_pod.py"
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


def replicated_job(runtime: dict) -> dict:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return job


def job_spec(runtime: dict) -> dict:
    return replicated_job(runtime)["template"]["spec"]


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (KEYWORD, its arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def image_env() -> dict:
    """The environment the image gives every container (its ENV lines)."""
    return dict(pair.split("=", 1) for keyword, args in dockerfile() if keyword == "ENV" for pair in args.split())


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


def schema_problems(document: dict) -> list[str]:
    """What the schemas of tests/k8s_api/ find wrong in ``document``: its CRD (Trainer's kinds), the
    OpenAPI definitions of its kind and the Kubernetes types it holds, and for a TrainingRuntime
    the JobSet CRD, whose spec its spec.template.spec is."""
    kind = document["kind"]
    found = [f"openapi: {p}" for p in openapi(kind).problems(document)]
    if kind in ("TrainJob", "TrainingRuntime"):
        found += [f"crd: {p}" for p in crd(kind).problems(document)]
    if kind == "TrainingRuntime":
        found += [f"jobset crd: {p}" for p in jobset_spec().problems(document["spec"]["template"]["spec"])]
    return found


NAMES = load("controllers.json")
POD_LABELS = {label for labels in NAMES["pod_labels"].values() for label in labels["values"].values()}
TRAINER = NAMES["trainer"]["values"]


def name_problems(document: dict, text: str = "") -> list[str]:
    """The labels, field paths, reasons, conditions and container names ``document`` (and the
    kubectl selectors in its file's ``text``) names that no controller sets (tests/k8s_api/
    controllers.json, read from their sources): the schemas take any string there."""
    found = []
    for selector in re.findall(r"kubectl .*?-l (\S+)", text):
        found += [f"selector: no controller sets the pod label {key}" for key in
                  (term.split("=")[0] for term in selector.split(",")) if key not in POD_LABELS]
    for key, value in document["metadata"].get("labels", {}).items():
        if NAMES["runtime_labels"]["values"].get(key) != value:
            found.append(f"metadata.labels: {key}: {value} is not a label of Trainer's shipped runtimes")
    if document["kind"] != "TrainingRuntime":
        return found
    jobset = document["spec"]["template"]["spec"]
    for rule in jobset.get("failurePolicy", {}).get("rules", []):
        found += [f"onJobFailureReasons: no Job fails with reason {reason}" for reason in rule["onJobFailureReasons"]
                  if reason not in NAMES["job_failure_reasons"]["values"].values()]
    ancestor = replicated_job(document)["template"]["metadata"]["labels"].get(TRAINER["LabelTrainJobAncestor"])
    if ancestor != TRAINER["AncestorTrainer"]:
        found.append(f"{TRAINER['LabelTrainJobAncestor']}: {ancestor} is not Trainer's trainer step")
    spec = job_spec(document)
    containers = [c["name"] for c in spec["template"]["spec"]["containers"]]
    if TRAINER["Node"] not in containers:
        found.append(f"containers: {containers}: none is the one Trainer fills ({TRAINER['Node']})")
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule and rule["onExitCodes"].get("containerName") not in (None, *containers):
            found.append(f"onExitCodes: containerName {rule['onExitCodes']['containerName']} is no container")
        found += [f"onPodConditions: no controller sets the pod condition {c['type']}"
                  for c in rule.get("onPodConditions", [])
                  if c["type"] not in NAMES["pod_condition_types"]["values"].values()]
    paths = [re.escape(p).replace(re.escape("<KEY>"), "(.+)") for p in downward_api_paths()]
    for container in spec["template"]["spec"]["containers"]:
        for item in container.get("env", []):
            field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field is None:
                continue
            match = next((m for p in paths if (m := re.fullmatch(p, field))), None)
            if match is None:
                found.append(f"env {item['name']}: the downward API has no field path {field}")
            elif field.startswith("metadata.labels") and match.group(1) not in POD_LABELS:
                found.append(f"env {item['name']}: no controller sets the pod label {match.group(1)}")
    return found


@pytest.mark.parametrize("name", sorted(p.name for p in KUBE.glob("*.yaml")))
def test_each_manifest_fits_the_schemas_and_names_only_what_the_controllers_set(name):
    assert schema_problems(manifest(name)) == []
    assert name_problems(manifest(name), (KUBE / name).read_text()) == []


# Each wrong value is found by the data of tests/k8s_api/ alone, with no expected value in the test;
# the first six are the misspellings the official models take without a word.
WRONG = {
    "action RestartJobSetAndIgnoreMaxRestart": (
        "runtime.yaml", lambda d: d["spec"]["template"]["spec"]["failurePolicy"]["rules"][0].update(
            action="RestartJobSetAndIgnoreMaxRestart"), "crd: spec.template.spec.failurePolicy.rules[0].action"),
    "reason PodFailurePolicyy": (
        "runtime.yaml", lambda d: d["spec"]["template"]["spec"]["failurePolicy"]["rules"][0].update(
            onJobFailureReasons=["PodFailurePolicyy"]), "no Job fails with reason PodFailurePolicyy"),
    "container nod": ("runtime.yaml", lambda d: node_container(d).update(name="nod"), "none is the one Trainer fills"),
    "ancestor trainr": (
        "runtime.yaml", lambda d: replicated_job(d)["template"]["metadata"]["labels"].update(
            {"trainer.kubeflow.org/trainjob-ancestor-step": "trainr"}), "trainr is not Trainer's trainer step"),
    "field path jobset-uuid": (
        "runtime.yaml", lambda d: node_container(d)["env"][0]["valueFrom"]["fieldRef"].update(
            fieldPath="metadata.labels['jobset.sigs.k8s.io/jobset-uuid']"), "no controller sets the pod label"),
    "condition DisruptionTargt": (
        "runtime.yaml", lambda d: job_spec(d)["podFailurePolicy"]["rules"][1]["onPodConditions"][0].update(
            type="DisruptionTargt"), "no controller sets the pod condition DisruptionTargt"),
    "podFailurePolicy action Failjob": (
        "runtime.yaml", lambda d: job_spec(d)["podFailurePolicy"]["rules"][0].update(action="Failjob"),
        "openapi: spec.template.spec.replicatedJobs[0].template.spec.podFailurePolicy.rules[0].action"),
    "operator in": (
        "runtime.yaml", lambda d: job_spec(d)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(operator="in"),
        "is not one of ['In', 'NotIn']"),
    "exit code container nod": (
        "runtime.yaml", lambda d: job_spec(d)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(
            containerName="nod"), "containerName nod is no container"),
    "restartPolicy never": ("runtime.yaml", lambda d: pod_spec(d).update(restartPolicy="never"), "'Never'"),
    "restart strategy": (
        "runtime.yaml", lambda d: d["spec"]["template"]["spec"]["failurePolicy"].update(restartStrategy="Blocking"),
        "restartStrategy"),
    "field path metadata.label": (
        "runtime.yaml", lambda d: node_container(d)["env"][0]["valueFrom"]["fieldRef"].update(
            fieldPath="metadata.label['jobset.sigs.k8s.io/jobset-uid']"), "the downward API has no field path"),
    "numNodes as a string": ("train_ddp.yaml", lambda d: d["spec"]["trainer"].update(numNodes="2"), "not an integer"),
    "a quantity that is none": (
        "train_ddp.yaml",
        lambda d: d["spec"]["trainer"]["resourcesPerNode"]["limits"].update({"nvidia.com/gpu": "four"}),
        "crd: spec.trainer.resourcesPerNode.limits.nvidia.com/gpu"),
    "access mode ReadWriteMany misspelt": (
        "runs_volume.yaml", lambda d: d["spec"].update(accessModes=["ReadWriteMAny"]), "ReadWriteMAny"),
    "storage class misspelt key": (
        "runs_volume.yaml", lambda d: d["spec"].update(storageClass="nfs-client"), "storageClass: unknown field"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_value_fails_against_the_schemas_alone(case):
    name, spoil, expected = WRONG[case]
    document = manifest(name)
    spoil(document)
    found = schema_problems(document) + name_problems(document)
    assert any(expected in problem for problem in found), found


def test_the_jobs_name_the_runtime_and_its_volume_and_run_torchrun_in_the_pod_entry():
    runtime, volume = manifest("runtime.yaml"), manifest("runs_volume.yaml")
    pod = pod_spec(runtime)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [volume["metadata"]["name"]] and volume["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volume["spec"]["storageClassName"]  # the cluster's default class is rarely ReadWriteMany
    runs = next(m["mountPath"] for m in node_container(runtime)["volumeMounts"] if m["name"] == "runs")
    # the image's caches (the dataset) on the volume: a restart does not download again
    assert Path(image_env()["XDG_CACHE_HOME"]).is_relative_to(runs)
    env = runtime_env()
    uid = "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"  # the same after a restart, new for a new job
    assert env[JOB_ID_VARIABLE]["valueFrom"]["fieldRef"]["fieldPath"] == uid
    for name, script in [("train_ddp.yaml", "scripts/train_ddp.py"), ("train_amp_bf16.yaml", "scripts/train_amp.py")]:
        trainjob = manifest(name)
        assert trainjob["spec"]["runtimeRef"]["kind"] == runtime["kind"]
        assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
        trainer = trainjob["spec"]["trainer"]
        assert trainer["command"] == ["python", str(POD_ENTRY.relative_to(ROOT)), script]
        assert trainer["image"] == node_container(runtime)["image"]
        # one process per GPU; Trainer's webhook refuses PET_* in trainer.env, and the runtime's env
        # must not set them either (the Torch plugin does)
        assert trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
        assert not [e for e in trainer.get("env", []) + node_container(runtime)["env"] if e["name"].startswith("PET_")]
    assert "--mixed-precision" in (amp := manifest("train_amp_bf16.yaml")["spec"]["trainer"]["args"])
    assert amp[amp.index("--mixed-precision") + 1] == "bf16"
    # the pod entry's constants are the training processes'
    entry = importlib.util.spec_from_file_location("torchrun_pod", POD_ENTRY)
    module = importlib.util.module_from_spec(entry)
    entry.loader.exec_module(module)
    assert (module.STOPPED, module.RECORDS) == (STOPPED_EXIT_CODE, STOP_RECORDS_VARIABLE)


def test_the_grace_period_holds_the_stop_and_torchruns_wait():
    """SIGTERM to SIGKILL: torchrun's wait for its processes (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), then
    torchrun's own exit, within the pod's grace period; the wait is what this torch reads."""
    runtime = manifest("runtime.yaml")
    wait = int(runtime_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])
    grace = pod_spec(runtime)["terminationGracePeriodSeconds"]
    assert grace >= wait + 30, (wait, grace)  # 30 s for torchrun's own exit (runtime.yaml's comment)
    launcher = Path(torch.__file__).parent / "distributed" / "launcher" / "api.py"
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in launcher.read_text()


def test_the_image_runs_as_the_runtimes_user_on_a_pinned_base_and_torch():
    """As far as this machine can check a Dockerfile (no Docker engine, no hadolint, no registry):
    the instructions, the base image by digest, torch at the release read here, a C compiler for
    Triton, not root."""
    instructions = dockerfile()
    known = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "LABEL", "EXPOSE", "ENTRYPOINT", "CMD"}
    assert {keyword for keyword, _ in instructions} <= known
    (base,) = [args for keyword, args in instructions if keyword == "FROM"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), base
    args = dict(a.split("=", 1) for keyword, a in instructions if keyword == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == torch.__version__.split("+")[0]  # the torch whose torchrun was read
    installs = [a for keyword, a in instructions if keyword == "RUN" and "pip install" in a]
    assert all("torch==$TORCH_VERSION" in a for a in installs if "torch" in a), installs
    # Triton's launcher is built at run time by the C compiler it finds (gcc), with the C library's
    # headers: the slim base has neither, and without them --compile auto would train eagerly
    packages = [a for keyword, a in instructions if keyword == "RUN" and "apt-get install" in a]
    assert len(packages) == 1 and {"gcc", "libc6-dev"} <= set(packages[0].split())
    assert "--no-install-recommends" in packages[0] and "rm -rf /var/lib/apt/lists" in packages[0]
    users = [a for keyword, a in instructions if keyword == "USER"]
    assert instructions[-1][0] == "USER" and users[-1].split(":")[0] not in ("0", "root")
    context = pod_spec(manifest("runtime.yaml"))["securityContext"]
    assert context["runAsNonRoot"] and users[-1] == f"{context['runAsUser']}:{context['runAsGroup']}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


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


def container_exit(returncode: int) -> int:
    """The exit code Kubernetes reports for a container whose PID 1 ended with ``returncode``
    (Popen's: -N for a signal): 128 + N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class Job:
    """A 2-node TrainJob of train_ddp.yaml in a workspace (the image's WORKDIR: scripts/, runs/),
    its pods simulated as the TrainJob's command (torchrun_pod.py, running torchrun) on this machine."""

    def __init__(self, workspace: Path, name: str):
        self.workspace, self.name, self.uid = workspace, name, str(uuid.uuid4())
        self.records = workspace / "exits" / name
        self.records.mkdir(parents=True)
        self.attempt = 0

    def pod_env(self, rank: int, port: int) -> dict:
        """The pod's environment: the image's, the runtime's env, the downward API's labels in it,
        and the Torch plugin's PET_* (on a cluster PET_MASTER_ADDR is train-ddp-node-0-0.train-ddp,
        the port 29500)."""
        labels = {"jobset.sigs.k8s.io/jobset-uid": self.uid, "jobset.sigs.k8s.io/jobset-name": self.name}
        env = {name: value for name, value in user_env().items()  # nothing of a launcher around this test
               if not name.startswith(("PET_", "TORCHELASTIC_", "SLURM_", JOB_ID_VARIABLE))}
        # the image's WORKDIR is the workspace; common/ from this checkout (installed in the image)
        env.update({name: value.replace("/workspace", str(self.workspace)) for name, value in image_env().items()})
        env.update(OMP_NUM_THREADS="1", EXIT_RECORDS=str(self.records),
                   PYTHONPATH=os.pathsep.join([str(self.workspace.parent / "probe"), str(ROOT)]))
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

    def checkpoints(self) -> list[int]:
        return sorted(int(p.name.rpartition("_")[2]) for p in (self.folder / "checkpoints").glob("step_*"))


def wait_for(done, pods, what: str, timeout=120):
    deadline = time.time() + timeout
    while not done():
        assert all(p.poll() is None for p in pods), f"a pod ended before {what}"
        assert time.time() < deadline, f"{what} never happened"
        time.sleep(0.05)


def finish(pods, timeout=180) -> list[int]:
    """The pods' exit codes as Kubernetes reports them; those still running after ``timeout`` are
    killed."""
    try:
        return [container_exit(p.wait(timeout)) for p in pods]
    except subprocess.TimeoutExpired:
        for p in pods:
            if p.poll() is None:
                lose_node(p)
        raise


def lose_node(pod: subprocess.Popen) -> None:
    """SIGKILL to every process of the pod at once, as when its node is lost: torchrun starts its
    workers in sessions of their own, and a worker whose agent dies first would stop with a
    checkpoint (PR_SET_PDEATHSIG), so the deepest processes go first."""
    entry = psutil.Process(pod.pid)
    for process in [*reversed(entry.children(recursive=True)), entry]:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
            process.send_signal(signal.SIGKILL)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def clean(output: str) -> bool:
    """No traceback or C++ abort from a training process. torchrun's own log lines are left out: a
    pod's agent whose peer agent, which holds the store, has already exited logs "Error waiting on
    exit barrier" with a traceback after its workers all exited 0 (seen in 1 of 4 runs)."""
    ours = "\n".join(line for line in output.splitlines() if not re.match(ELASTIC_LOG, line))
    return "Traceback" not in ours and "terminate called" not in ours


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The image's WORKDIR: the project's scripts/ and accelerate_configs/ (common/ is installed),
    runs/ for the volume."""
    folder = tmp_path_factory.mktemp("k8s") / "workspace"
    folder.mkdir()
    for name in ("scripts", "accelerate_configs"):
        (folder / name).symlink_to(ROOT / name)
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
    script, *flags = job.command(job.pod_env(0, 0))[2:]  # python torchrun_pod.py SCRIPT FLAGS
    processes = Processes(workspace / script, *flags, cwd=workspace)  # rank0.out ... in the workspace

    def ended() -> Path:
        assert processes.wait(timeout=240) == [0, 0], processes.output()
        assert all(clean(processes.stderr(rank)) for rank in (0, 1)), processes.output()
        return job.folder

    yield ended
    processes.kill()  # a test that failed before the reference ended


def stopped_by_sigterm(job: Job, signalled: list[int]) -> dict:
    """Both pods started again; once they saved a checkpoint newer than the one they resumed from,
    SIGTERM to PID 1 of the ``signalled`` pods' containers (an eviction, a deletion, a suspension)."""
    before = max(job.checkpoints(), default=0)
    pods = job.start()
    wait_for(lambda: max(job.checkpoints(), default=0) > before, pods, f"a checkpoint after step {before}")
    sent = time.perf_counter()
    for rank in signalled:
        pods[rank].send_signal(signal.SIGTERM)
    codes = finish(pods, timeout=300)
    return {"codes": codes, "seconds": time.perf_counter() - sent, "exits": job.exits(), "resumed": before,
            "listed": listing(job.folder), "attempt": job.attempt, "signalled": signalled}


@pytest.fixture(scope="module")
def interrupted(workspace, reference):
    """The TrainJob with a pod killed after the step-2 checkpoint (a crash), then restarted each
    time: the first pod evicted, the second pod evicted, both stopped by a suspension, and
    the job finished."""
    job = Job(workspace, "train-ddp")
    found = {}
    pods = job.start()
    wait_for(lambda: 2 in job.checkpoints(), pods, "the step-2 checkpoint")
    lose_node(pods[1])
    killed = time.perf_counter()
    found["crash"] = {"codes": finish(pods, timeout=120), "seconds": time.perf_counter() - killed,
                      "exits": job.exits(), "attempt": job.attempt}
    # each start after the first is the JobSet's restart, which the runtime's policies decide
    # from the pods' exit statuses (restarts_table: every order)
    previous = "crash"
    # pod 0 holds torchrun's store; a suspended Job deletes every pod
    for scenario, signalled in [("pod 0 evicted", [0]), ("pod 1 evicted", [1]), ("suspended", [0, 1])]:
        the_jobset_restarts(found, previous)
        found[scenario], previous = stopped_by_sigterm(job, signalled), scenario
    the_jobset_restarts(found, previous)
    pods = job.start()
    found["finished"] = {"codes": finish(pods), "exits": job.exits(), "attempt": job.attempt}
    found["outputs"] = {attempt: [job.output(attempt, rank) for rank in (0, 1)] for attempt in range(1, 6)}
    return job, found


def test_a_lost_pod_fails_the_other_pod_at_once(interrupted):
    """The other pod's worker meets the closed connection in its next all-reduce and says so in one
    line, with gloo's words (common.failures); its pod exits 1: the Job fails, counted."""
    _, found = interrupted
    crash = found["crash"]
    survivor = found["outputs"][1][0]
    print(f"\na pod lost: the other pod ended {crash['seconds']:.1f} s later")
    assert crash["codes"] == [1, 128 + signal.SIGKILL] and crash["seconds"] < 60, survivor[-3000:]
    lines = re.findall(r"error: .*", survivor)
    assert len(lines) == 1 and re.match(r"error: process 0 lost another process of the job in a collective "
                                        r"\(.*Connection (closed|reset) by peer", lines[0]), survivor[-3000:]
    assert re.search(r"exitcode\s*: 1 ", survivor) and bad_ends(survivor) == [], survivor[-3000:]
    assert crash["exits"] == {}  # neither worker reached sys.exit: one killed, one ended (os._exit) in the all-reduce


@pytest.mark.parametrize("scenario", ["pod 0 evicted", "pod 1 evicted", "suspended"])
def test_a_sigterm_stops_every_pod_with_a_checkpoint_and_exit_75(interrupted, scenario):
    """SIGTERM to one pod (evicted) or to both (suspended): every worker of the job stops after the
    same step, saves and exits 75; torchrun exits 1 in every pod, through its signal path in a pod
    that got the SIGTERM and through a worker's failure in the other, and torchrun_pod.py turns
    that into 75; the job started again continues from that checkpoint by itself."""
    job, found = interrupted
    stop = found[scenario]
    outputs = found["outputs"][stop["attempt"]]
    wait = int(runtime_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])
    print(f"\n{scenario}: SIGTERM to the end of both pods {stop['seconds']:.1f} s (torchrun waits {wait} s)")
    assert stop["codes"] == [STOPPED, STOPPED] and stop["seconds"] < wait, outputs
    assert sorted(stop["exits"].values()) == [STOPPED, STOPPED] and len(stop["exits"]) == 2, stop["exits"]
    resumed = f"resumed from runs/train-ddp/checkpoints/step_{stop['resumed']:08d}"
    assert resumed in outputs[0], outputs[0][-3000:]
    # one line from each node's first process; after a signal to another node's, it says so
    steps = {int(step) for step in re.findall(r"stopped by (?:SIGTERM|a stop signal to another process) "
                                              r"after step (\d+)", "".join(outputs))}
    assert len(steps) == 1, outputs
    (step,) = steps
    assert step > stop["resumed"] and f"checkpoints/step_{step:08d}" in stop["listed"]
    assert "model.safetensors" not in stop["listed"]
    assert f"resumed from runs/train-ddp/checkpoints/step_{step:08d}" in found["outputs"][stop["attempt"] + 1][0]
    for rank, output in enumerate(outputs):
        # torchrun alone exits 1: in its signal path (SignalException) or in its failure path
        path = "SignalException: Process" if rank in stop["signalled"] else "errors.ChildFailedError:"
        assert f"torchrun_pod.py: torchrun exited 1, every training process of this pod stopped" in output, output
        assert output.count("Traceback") == output.count(path) == 1, output[-3000:]  # torchrun's own only
        assert "terminate called" not in output


def test_the_job_started_again_ends_at_the_weights_of_an_uninterrupted_run(interrupted, reference):
    job, found = interrupted
    finished = found["finished"]
    outputs = found["outputs"][5]
    assert finished["codes"] == [0, 0] and sorted(finished["exits"].values()) == [0, 0], outputs
    assert all(map(clean, outputs)), [output[-3000:] for output in outputs]
    assert "--resume" not in job.command(job.pod_env(0, 1))  # by itself
    assert_same_weights(job.folder, reference())
    records = [json.loads(line) for line in (job.folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 8), (2, 16)]  # one run, one record


EVICTED = ("DisruptionTarget", "True")  # the condition an eviction (API, scheduler, kubelet) gives a pod


def failed_pods(found: dict, scenario: str) -> list[Pod]:
    """The pods of ``scenario`` as the Job controller reads them: each one's exit status as it
    really ended, the eviction's condition on the pod it evicted, untracked in a suspended Job."""
    run = found[scenario]
    return [Pod(f"node-0-{rank}", code, (EVICTED,) if scenario.endswith("evicted") and rank in run["signalled"]
                else (), tracked=scenario != "suspended")
            for rank, code in enumerate(run["codes"]) if code != 0]


def the_jobset_restarts(found: dict, scenario: str) -> None:
    """The runtime's policies restart the job after ``scenario``, whichever pod fails first."""
    pods = failed_pods(found, scenario)
    actions = {outcome(manifest("runtime.yaml"), list(order))[1] for order in itertools.permutations(pods)}
    assert actions <= {"RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"} and actions, (scenario, actions)


def restarts_table(runtime: dict, found: dict) -> list[tuple[str, str, str | None, str | None, int]]:
    """(what happened, the pod the Job controller sees fail first, the Job's reason, the JobSet's
    action, restarts counted against maxRestarts), for every order of the pods' failures."""
    rows = []
    for scenario in ("crash", "pod 0 evicted", "pod 1 evicted", "suspended", "finished"):
        pods = failed_pods(found, scenario)
        for order in itertools.permutations(pods) if pods else [()]:
            first = (f"{order[0].name} (exit {order[0].exit_code}"
                     + "".join(f", {kind}" for kind, _ in order[0].conditions) + ")") if order else "none fails"
            rows.append((scenario, first, *outcome(runtime, list(order))))
    return rows


def test_a_stop_never_counts_against_max_restarts_and_a_crash_does(interrupted):
    """The table of item 1: whichever pod the Job controller sees fail first, an eviction of
    either pod and a suspension restart the job without counting; a crash counts."""
    _, found = interrupted
    runtime = manifest("runtime.yaml")
    rows = restarts_table(runtime, found)
    print("\n| what happened | seen first | Job's reason | JobSet's action | counted |")
    print("\n".join(f"| {' | '.join(map(str, row))} |" for row in rows))
    expected = {"crash": ("BackoffLimitExceeded", "RestartJobSet", 1),
                "pod 0 evicted": ("PodFailurePolicy", "RestartJobSetAndIgnoreMaxRestarts", 0),
                "pod 1 evicted": ("PodFailurePolicy", "RestartJobSetAndIgnoreMaxRestarts", 0),
                # a FailJob match fails even a suspended Job (getFailJobMessage reads every pod); a
                # sync that comes after the pods are gone finds nothing: free either way
                "suspended": ("PodFailurePolicy", "RestartJobSetAndIgnoreMaxRestarts", 0),
                "finished": (None, None, 0)}
    assert [(row[0], row[2:]) for row in rows] == [(row[0], expected[row[0]]) for row in rows]
    assert len(rows) == 9  # both orders of every failure
    # Negative controls, the same exit statuses: without the exit-code rule (the policy before), an
    # eviction counts when the controller sees the other pod fail first; a JobSet rule naming
    # another reason counts every stop.
    spoilt = copy.deepcopy(runtime)
    job_spec(spoilt)["podFailurePolicy"]["rules"].pop(0)
    peer_first = [row for row in restarts_table(spoilt, found) if row[0] == "pod 1 evicted" and "node-0-0" in row[1]]
    assert [row[2:] for row in peer_first] == [("BackoffLimitExceeded", "RestartJobSet", 1)]
    spoilt = copy.deepcopy(runtime)
    spoilt["spec"]["template"]["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] = ["DeadlineExceeded"]
    assert {row[4] for row in restarts_table(spoilt, found) if row[0] != "finished"} == {1}


# ------------------------------------------------------------------------------ torchrun's wait


def test_torchruns_wait_for_its_processes_is_torch_elastic_shutdown_timeout(tmp_path):
    """A process that needs 5 s to stop after a SIGTERM: torchrun SIGKILLs it under a 1 s wait, and
    lets it finish under a 10 s one. Both launches at once, each --standalone (a port of its own)."""
    runs = {}
    for wait in (1, 10):
        out = tmp_path / f"wait{wait}"
        out.mkdir()
        env = {**user_env(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(wait), "OMP_NUM_THREADS": "1"}
        log = open(out / "torchrun.log", "w")
        runs[wait] = out, subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", str(ROOT / "tests" / "slow_stop.py"),
             str(out), "5"], env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
    for out, launcher in runs.values():
        wait_for(lambda: (out / "ready").exists(), [launcher], "the process's start", timeout=60)
    sent = time.perf_counter()
    for _, launcher in runs.values():
        launcher.send_signal(signal.SIGTERM)
    ended = {}
    for wait, (out, launcher) in runs.items():
        ended[wait] = launcher.wait(30), time.perf_counter() - sent, (out / "stopped").exists()
    print(f"\nSIGTERM to torchrun's end: {ended[1][1]:.1f} s under a 1 s wait, {ended[10][1]:.1f} s under 10 s")
    killed, finished = (runs[w][0] / "torchrun.log" for w in (1, 10))
    # torchrun exits 1 after passing a signal on, either way (torch's SignalException)
    assert ended[1][0] == 1 and not ended[1][2] and ended[1][1] < 5, killed.read_text()
    forced = r"Unable to shutdown process \d+ via (15|Signals.SIGTERM), forcefully exiting via (9|Signals.SIGKILL)"
    assert re.search(forced, killed.read_text()), killed.read_text()
    assert ended[10][0] == 1 and ended[10][2] and 5 <= ended[10][1] < 10, finished.read_text()
    assert "forcefully exiting" not in finished.read_text()


def test_the_pod_entry_warns_when_its_torch_ignores_the_wait(tmp_path):
    """A torch from before pytorch PR #172596 kills the processes 30 s after a SIGTERM whatever
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT says: torchrun_pod.py says so in one line; this torch, nothing."""
    old = tmp_path / "torch"
    (old / "distributed" / "launcher").mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "distributed" / "launcher" / "api.py").write_text("shutdown_timeout = 30\n")
    call = f"import runpy; runpy.run_path({str(POD_ENTRY)!r})['warn_if_the_wait_is_ignored']()"
    env = {**user_env(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    ours = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, check=True)
    theirs = subprocess.run([sys.executable, "-c", call], env={**env, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, check=True)
    assert ours.stderr == ""
    assert theirs.stderr == (f"warning: this torch ({old / 'distributed' / 'launcher' / 'api.py'}) does not read "
                             f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torchrun SIGKILLs the training processes 30 s after "
                             f"a SIGTERM; use the torch the Dockerfile pins\n")
