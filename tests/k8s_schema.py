"""A manifest checked against an OpenAPI v3 schema the way the API server checks it, for the parts
a schema holds: known fields only (kubectl's default field validation, Strict), types, enums,
required fields, patterns, bounds. The CEL rules (x-kubernetes-validations) and the checks written
in Go (that a podFailurePolicy's containerName names a container, say) are not in the schema:
tests/test_kubernetes.py checks those it needs itself.

The schema files are in tests/k8s_api/ (README.md: their sources), trimmed to what the manifests
use: a field whose schema was trimmed is reported as such, to be extracted again.
"""

import difflib
import json
import re
from pathlib import Path

API = Path(__file__).parent / "k8s_api"
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}
INT_RANGE = {"int32": 2**31, "int64": 2**63}


def load(name: str) -> dict:
    return json.loads((API / name).read_text())


class Schema:
    """Checks values against ``root`` (``definitions``: where the $refs of an OpenAPI file point)."""

    def __init__(self, root: dict, definitions: dict | None = None):
        self.root, self.definitions = root, definitions or {}

    def problems(self, value) -> list[str]:
        found = []
        self._check(self.root, value, "", found)
        return found

    def _resolve(self, node: dict) -> dict:
        refs = [node["$ref"]] if "$ref" in node else [s["$ref"] for s in node.get("allOf", []) if "$ref" in s]
        merged = {k: v for k, v in node.items() if k not in ("$ref", "allOf")}
        for ref in refs:
            merged = {**self._resolve(self.definitions[ref.rsplit("/", 1)[1]]), **merged}
        return merged

    def _check(self, node: dict, value, path: str, found: list[str]) -> None:
        node = self._resolve(node)
        where = path or "(top)"
        if node.get("x-trimmed"):
            found.append(f"{where}: its schema was trimmed from tests/k8s_api/; extract it again (README.md)")
            return
        if value is None and node.get("nullable"):
            return
        branches = node.get("anyOf") or node.get("oneOf")
        if branches:
            if all(self._branch_problems(branch, value, path) for branch in branches):
                found.append(f"{where}: {value!r} matches none of {[b.get('type') for b in branches]}")
                return
        kind = node.get("type")
        if kind == "integer":
            if not isinstance(value, int) or isinstance(value, bool):
                found.append(f"{where}: {value!r} is not an integer")
                return
            bound = INT_RANGE.get(node.get("format"))
            if bound and not -bound <= value < bound:
                found.append(f"{where}: {value} is out of {node['format']}'s range")
        elif kind in TYPES:
            if not isinstance(value, TYPES[kind]) or (kind == "number" and isinstance(value, bool)):
                found.append(f"{where}: {value!r} is not of type {kind}")
                return
        if "enum" in node and value not in node["enum"]:
            found.append(f"{where}: {value!r} is not one of {node['enum']}")
        if isinstance(value, str):
            if "pattern" in node and not re.search(node["pattern"], value):
                found.append(f"{where}: {value!r} does not match {node['pattern']}")
            if len(value) > node.get("maxLength", len(value)) or len(value) < node.get("minLength", 0):
                found.append(f"{where}: {value!r} has a length out of bounds")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < node.get("minimum", value) or value > node.get("maximum", value):
                found.append(f"{where}: {value} is out of [{node.get('minimum')}, {node.get('maximum')}]")
        if isinstance(value, list):
            if len(value) > node.get("maxItems", len(value)) or len(value) < node.get("minItems", 0):
                found.append(f"{where}: {len(value)} items, out of bounds")
            for i, item in enumerate(value):
                if "items" in node:
                    self._check(node["items"], item, f"{path}[{i}]", found)
        if isinstance(value, dict):
            self._check_object(node, value, path, found)

    def _check_object(self, node: dict, value: dict, path: str, found: list[str]) -> None:
        for key in node.get("required", []):
            if key not in value:
                found.append(f"{path or '(top)'}: the required field {key!r} is missing")
        properties, extra = node.get("properties"), node.get("additionalProperties")
        for key, item in value.items():
            here = f"{path}.{key}" if path else key
            if properties is not None and key in properties:
                self._check(properties[key], item, here, found)
            elif isinstance(extra, dict):
                self._check(extra, item, here, found)
            elif properties is not None and not node.get("x-kubernetes-preserve-unknown-fields") \
                    and extra is not True:
                close = difflib.get_close_matches(key, properties, n=1)
                found.append(f"{here}: unknown field" + (f" (did you mean {close[0]!r}?)" if close else ""))

    def _branch_problems(self, branch: dict, value, path: str) -> list[str]:
        found = []
        self._check(branch, value, path, found)
        return found


def crd(kind: str) -> Schema:
    """The Trainer CRD's schema of ``kind`` (v1alpha1): what the API server checks a manifest with."""
    return Schema(load("trainer-v2.3.0-crds.json")["schemas"][kind])


def jobset_spec() -> Schema:
    """The JobSet CRD's spec, which a TrainingRuntime's spec.template.spec is."""
    return Schema(load("jobset-v0.12.0-crd.json")["schema"])


def openapi(kind: str) -> Schema:
    """The OpenAPI definition of ``kind``, with the Kubernetes types it reaches (their enums)."""
    data = load("trainer-v2.3.0-openapi.json")
    return Schema(data["definitions"][data["roots"][kind]], data["definitions"])


def downward_api_paths() -> list[str]:
    """The field paths the downward API takes in an env var, from EnvVarSource.fieldRef's own
    description: `metadata.labels['<KEY>']` and the like."""
    fields = load("trainer-v2.3.0-openapi.json")["definitions"]["io.k8s.api.core.v1.EnvVarSource"]["properties"]
    description = fields["fieldRef"]["description"]
    listed = description.split("supports ", 1)[1].rstrip(".")
    return [item.strip().strip("`") for item in listed.split(",")]
