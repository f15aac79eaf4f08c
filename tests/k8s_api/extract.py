"""Writes this folder's schema files from the upstream sources (README.md says which), trimmed to
what accelerate_configs/kubernetes/ uses. Run it again after a manifest uses a field that a file
holds only as a stub ({"x-trimmed": true}), or to move to other upstream versions:

    python tests/k8s_api/extract.py --trainer TRAINER.git --jobset JOBSET.git --api API.git

each a clone of github.com/kubeflow/trainer, kubernetes-sigs/jobset, kubernetes/api (a bare clone
is enough: the files are read with git show at the tags below).

Trimmed: every object schema a manifest reaches keeps the names of all its properties, so that a
misspelt key still fails; the schemas of the properties no manifest uses become stubs, and
descriptions are dropped but the one that lists the downward API's field paths.
"""

import argparse
import json
import re
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).parent
KUBE = HERE.parent.parent / "accelerate_configs" / "kubernetes"
TRAINER_TAG, JOBSET_TAG, API_TAG = "v2.3.0", "v0.12.0", "v0.36.2"
CRDS = {"TrainingRuntime": "manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml",
        "TrainJob": "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"}
JOBSET_CRD = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
OPENAPI = "api/openapi-spec/swagger.json"
# The definitions of the OpenAPI file that each manifest's kind starts from
ROOTS = {"TrainingRuntime": "trainer.v1alpha1.TrainingRuntime", "TrainJob": "trainer.v1alpha1.TrainJob",
         "PersistentVolumeClaim": "io.k8s.api.core.v1.PersistentVolumeClaim"}
KEEP_DESCRIPTION = "supports metadata.name"  # EnvVarSource.fieldRef: the downward API's field paths


def show(git_dir: str, tag: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{tag}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def commit(git_dir: str, tag: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "rev-parse", f"{tag}^{{commit}}"], check=True,
                          capture_output=True, text=True).stdout.strip()


class Trimmer:
    """Walks manifests through a schema (``definitions``: the $ref targets, if any), marking the
    properties each schema node was given; ``trimmed`` copies the nodes reached."""

    def __init__(self, definitions: dict | None = None):
        self.definitions, self.used, self.reached = definitions or {}, {}, set()

    def ref(self, node: dict) -> dict | None:
        target = node.get("$ref") or next((s["$ref"] for s in node.get("allOf", []) if "$ref" in s), None)
        return self.definitions[target.rsplit("/", 1)[1]] if target else None

    def walk(self, node: dict, value) -> None:
        self.reached.add(id(node))
        if (target := self.ref(node)) is not None:
            self.walk(target, value)
        for branch in node.get("anyOf", []) + node.get("oneOf", []):
            self.walk(branch, value)
        if isinstance(value, dict) and "properties" in node:
            for key, item in value.items():
                if key in node["properties"]:
                    self.used.setdefault(id(node), set()).add(key)
                    self.walk(node["properties"][key], item)
        elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            for item in value.values():
                self.walk(node["additionalProperties"], item)
        elif isinstance(value, list) and "items" in node:
            for item in value:
                self.walk(node["items"], item)

    def trimmed(self, node: dict) -> dict:
        if id(node) not in self.reached:
            return {"x-trimmed": True}
        out = {}
        for key, value in node.items():
            if key == "description" and KEEP_DESCRIPTION not in value:
                continue
            if key == "properties":
                used = self.used.get(id(node), set())
                out[key] = {name: self.trimmed(sub) if name in used else {"x-trimmed": True}
                            for name, sub in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = self.trimmed(value)
            elif key in ("anyOf", "oneOf", "allOf"):
                out[key] = [self.trimmed(sub) if "$ref" not in sub else sub for sub in value]
            elif key == "x-kubernetes-v2-schema":
                continue
            else:
                out[key] = value
        return out


def manifests() -> dict[str, list[dict]]:
    found = {}
    for path in sorted(KUBE.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        found.setdefault(document["kind"], []).append(document)
    return found


def write(name: str, data: dict) -> None:
    (HERE / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def go_constants(source: str, names: list[str]) -> dict[str, str]:
    """The string values of the Go constants ``names`` in ``source``."""
    found = {}
    for name in names:
        match = re.search(rf"^\s*{name}\s+(?:\w+\s+)?=\s+(?:labelPrefix \+ )?\"([^\"]+)\"", source, re.M)
        found[name] = ("batch.kubernetes.io/" if "labelPrefix +" in match.group(0) else "") + match.group(1)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--jobset", required=True)
    parser.add_argument("--api", required=True)
    args = parser.parse_args()
    found = manifests()

    crds = {}
    for kind, path in CRDS.items():
        (version,) = [v for v in yaml.safe_load(show(args.trainer, TRAINER_TAG, path))["spec"]["versions"]
                      if v["name"] == "v1alpha1"]
        schema = version["schema"]["openAPIV3Schema"]
        trimmer = Trimmer()
        for document in found.get(kind, []):
            trimmer.walk(schema, document)
        crds[kind] = trimmer.trimmed(schema)
    source = {"repo": "kubeflow/trainer", "tag": TRAINER_TAG, "commit": commit(args.trainer, TRAINER_TAG),
              "paths": list(CRDS.values()), "version": "v1alpha1"}
    write(f"trainer-{TRAINER_TAG}-crds.json", {"source": source, "schemas": crds})

    (version,) = yaml.safe_load(show(args.jobset, JOBSET_TAG, JOBSET_CRD))["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    trimmer = Trimmer()
    for document in found["TrainingRuntime"]:
        trimmer.walk(schema, document["spec"]["template"]["spec"])
    source = {"repo": "kubernetes-sigs/jobset", "tag": JOBSET_TAG, "commit": commit(args.jobset, JOBSET_TAG),
              "path": JOBSET_CRD, "version": version["name"], "part": "spec"}
    write(f"jobset-{JOBSET_TAG}-crd.json", {"source": source, "schema": trimmer.trimmed(schema)})

    definitions = json.loads(show(args.trainer, TRAINER_TAG, OPENAPI))["components"]["schemas"]
    trimmer = Trimmer(definitions)
    for kind, root in ROOTS.items():
        for document in found.get(kind, []):
            trimmer.walk(definitions[root], document)
    kept = {name: trimmer.trimmed(node) for name, node in definitions.items() if id(node) in trimmer.reached}
    source = {"repo": "kubeflow/trainer", "tag": TRAINER_TAG, "commit": commit(args.trainer, TRAINER_TAG),
              "path": OPENAPI, "kubernetes_types": f"k8s.io/api {API_TAG} (trainer's go.mod)"}
    write(f"trainer-{TRAINER_TAG}-openapi.json", {"source": source, "roots": ROOTS, "definitions": kept})

    # The names the controllers set, read from their sources
    pods_labels = "pkg/controllers/jobset_controller.go"
    labelled = re.findall(r"labels\[jobset\.(\w+)\]", show(args.jobset, JOBSET_TAG, pods_labels))
    jobset_types = "api/jobset/v1alpha2/jobset_types.go"
    trainer_constants = "pkg/constants/constants.go"
    batch_types, core_types = "batch/v1/types.go", "core/v1/types.go"
    batch = show(args.api, API_TAG, batch_types)
    core = show(args.api, API_TAG, core_types)
    reasons = re.findall(r"^\s*(JobReason\w+)\s+string\s+=", batch, re.M)
    conditions = re.findall(r"^\s*(\w+)\s+PodConditionType\s+=", core, re.M)
    shipped = "manifests/base/runtimes/torch_distributed.yaml"
    runtime_labels = yaml.safe_load(show(args.trainer, TRAINER_TAG, shipped))["metadata"]["labels"]
    names = {
        "runtime_labels": {"source": {"repo": "kubeflow/trainer", "tag": TRAINER_TAG, "paths": [shipped],
                                      "note": "the labels of the shipped torch-distributed runtime"},
                           "values": runtime_labels},
        "pod_labels": {
            "jobset": {"source": {"repo": "kubernetes-sigs/jobset", "tag": JOBSET_TAG,
                                  "paths": [jobset_types, pods_labels + " (labelAndAnnotateObject: the Job "
                                                                        "and its pod template)"]},
                       "values": go_constants(show(args.jobset, JOBSET_TAG, jobset_types), labelled)},
            "job": {"source": {"repo": "kubernetes/api", "tag": API_TAG, "paths": [batch_types]},
                    "values": go_constants(batch, ["JobCompletionIndexAnnotation"])},
        },
        "trainer": {"source": {"repo": "kubeflow/trainer", "tag": TRAINER_TAG, "paths": [trainer_constants]},
                    "values": go_constants(show(args.trainer, TRAINER_TAG, trainer_constants),
                                           ["LabelTrainJobAncestor", "AncestorTrainer", "Node"])},
        "job_failure_reasons": {"source": {"repo": "kubernetes/api", "tag": API_TAG, "paths": [batch_types]},
                                "values": go_constants(batch, reasons)},
        "pod_condition_types": {"source": {"repo": "kubernetes/api", "tag": API_TAG, "paths": [core_types]},
                                "values": go_constants(core, conditions)},
    }
    write("controllers.json", names)


if __name__ == "__main__":
    main()
