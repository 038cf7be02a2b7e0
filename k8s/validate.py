#!/usr/bin/env python3
"""Offline checks of genfleet's Kubernetes manifests; scripts/validate-k8s.sh runs it.

No cluster is involved. For every kustomization under k8s/ (the base, each overlay, and each
component on top of the base), or under the directories given, it:

1. renders it with `kubectl kustomize` (kustomize built into kubectl; it reads local files only);
2. validates every rendered object against the Kubernetes OpenAPI schemas that the
   kubernetes-validate package bundles, in strict mode (an unknown field is an error), for each
   Kubernetes version asked for, plus the enumerated values those schemas leave out; custom
   resources (KEDA's ScaledObject) against the JSON schemas in k8s/schemas/; an object with no
   schema at all is an error, never skipped;
3. checks what the schemas cannot see: references between objects (selectors, ConfigMaps,
   ServiceAccounts, named ports, autoscaler targets), and genfleet's own rules: settings keys
   that exist in config/default.toml (genfleet refuses unknown keys), values of the right type,
   files that are mounted, a termination grace period that covers the drain, probes on the
   worker's and the gateway's HTTP port, KEDA's triggers matching the pool (the stream and
   consumer names, the scaling Service and its targets), manager rules.

It also checks k8s/nats/values.yaml (YAML, the chart's top-level keys, the settings genfleet
relies on). Exit status 0 when all is valid, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml
from referencing import Registry, Resource

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

# Options of `genfleet` that take a value, to find the subcommand among a container's args.
GLOBAL_OPTIONS_WITH_VALUE = {"--config", "--log-format"}

# Settings that name a file or directory that must be there when genfleet starts.
PATH_SETTINGS = {
    ("nats", "nkey_seed_file"),
    ("nats", "credentials_file"),
    ("nats", "tls_ca_file"),
    ("nats", "tls_cert_file"),
    ("nats", "tls_key_file"),
    ("tools", "definitions_dir"),
    ("manager", "rules_file"),
    ("gateway", "api_keys_file"),
}

# The Kubernetes schemas carry no enumerations (the API documents them in prose), so a value
# like `imagePullPolicy: Sometimes` passes them: the enumerated fields these manifests use are
# checked here. (kind pattern, dotted path pattern, allowed values)
ENUMERATIONS = [
    (r".*", r"(^|\.)imagePullPolicy$", {"Always", "Never", "IfNotPresent"}),
    (r".*", r"(^|\.)restartPolicy$", {"Always", "OnFailure", "Never"}),
    (r".*", r"\.ports\.\d+\.protocol$", {"TCP", "UDP", "SCTP"}),
    (r".*", r"httpGet\.scheme$", {"HTTP", "HTTPS"}),
    (r".*", r"seccompProfile\.type$", {"RuntimeDefault", "Unconfined", "Localhost"}),
    (r".*", r"topologySpreadConstraints\.\d+\.whenUnsatisfiable$",
     {"DoNotSchedule", "ScheduleAnyway"}),
    (r".*", r"matchExpressions\.\d+\.operator$", {"In", "NotIn", "Exists", "DoesNotExist"}),
    (r"Deployment", r"^spec\.strategy\.type$", {"RollingUpdate", "Recreate"}),
    (r"Service", r"^spec\.type$", {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"}),
    (r"Service", r"^spec\.(external|internal)TrafficPolicy$", {"Cluster", "Local"}),
    (r"NetworkPolicy", r"^spec\.policyTypes\.\d+$", {"Ingress", "Egress"}),
    (r"PodDisruptionBudget", r"^spec\.unhealthyPodEvictionPolicy$",
     {"IfHealthyBudget", "AlwaysAllow"}),
    (r"HorizontalPodAutoscaler", r"^spec\.metrics\.\d+\.type$",
     {"Resource", "Pods", "Object", "External", "ContainerResource"}),
    (r"HorizontalPodAutoscaler", r"\.target\.type$", {"Utilization", "Value", "AverageValue"}),
    (r"HorizontalPodAutoscaler", r"\.policies\.\d+\.type$", {"Pods", "Percent"}),
    (r"HorizontalPodAutoscaler", r"\.selectPolicy$", {"Max", "Min", "Disabled"}),
]

# Sections that accept keys config/default.toml does not list (tuning knobs with built-in
# defaults): only the listed keys' types are checked there.
OPEN_SECTIONS = {"loop_detection"}

# Keys of a [[rule]] in a manager rules file (docs/manager.md, "Policy rules").
MANAGER_RULE_KEYS = {
    "type", "code", "kind", "job_name", "pool", "meta", "metadata",
    "answer", "action", "after_ms", "rationale", "guidance", "modified_prompt",
    "confidence_boost",
}

# Top-level keys of the NATS Helm chart's values (the same from chart 1.0 to 2.x).
NATS_CHART_TOP_LEVEL_KEYS = {
    "global", "nameOverride", "fullnameOverride", "namespaceOverride", "tlsCA", "config",
    "container", "reloader", "promExporter", "service", "statefulSet", "podTemplate",
    "headlessService", "configMap", "podDisruptionBudget", "serviceAccount", "natsBox",
    "extraResources",
}

# After the drain deadline and the cancellations (worker.cancel_wait_ms), the worker flushes
# its last messages to NATS for up to this long before it exits.
FLUSH_SECONDS = 2


# ---------------------------------------------------------------------------------------------
# Rendering


@dataclass
class Target:
    """One thing to render: a kustomization, or a component on top of the base."""

    label: str
    directory: Path
    component: Path | None = None


def load_kustomization(directory: Path) -> dict | None:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return yaml.safe_load((directory / name).read_text()) or {}
    return None


def shown(path: Path, shown_from: Path) -> str:
    relative = os.path.relpath(path, shown_from)
    return str(path) if relative.startswith("..") else relative


def find_targets(root: Path, base: Path, shown_from: Path) -> list[Target]:
    """Every kustomization in or under root; each component on top of base."""
    targets = []
    components = []
    for directory in sorted([root] + [p for p in root.rglob("*") if p.is_dir()]):
        kustomization = load_kustomization(directory)
        if kustomization is None:
            continue
        kind = kustomization.get("kind", "Kustomization")
        label = shown(directory, shown_from)
        if kind == "Component":
            components.append((label, directory))
        else:
            targets.append(Target(label, directory))
    for label, directory in components:
        targets.append(Target(f"{label} (on {shown(base, shown_from)})", base,
                              component=directory))
    return targets


def render(kubectl: str, target: Target) -> tuple[list[dict], str | None]:
    """The objects a target renders to, or an error message."""
    with tempfile.TemporaryDirectory(prefix="genfleet-k8s-") as tmp:
        directory = target.directory
        if target.component is not None:
            # As an overlay would: the base's namespace also for the component's resources.
            # (kustomize accepts only relative paths in resources and components.)
            namespace = (load_kustomization(target.directory) or {}).get("namespace")
            Path(tmp, "kustomization.yaml").write_text(
                "apiVersion: kustomize.config.k8s.io/v1beta1\n"
                "kind: Kustomization\n"
                + (f"namespace: {namespace}\n" if namespace else "")
                +
                f"resources:\n  - {os.path.relpath(target.directory, tmp)}\n"
                f"components:\n  - {os.path.relpath(target.component, tmp)}\n"
            )
            directory = Path(tmp)
        try:
            done = subprocess.run(
                [kubectl, "kustomize", str(directory)],
                capture_output=True, text=True, timeout=120,
            )
        except subprocess.TimeoutExpired:
            return [], "kubectl kustomize took more than 120 s"
    if done.returncode != 0:
        return [], "kubectl kustomize failed: " + done.stderr.strip()
    try:
        objects = [o for o in yaml.safe_load_all(done.stdout) if o is not None]
    except yaml.YAMLError as error:
        return [], f"the rendered YAML does not parse: {error}"
    return objects, None


# ---------------------------------------------------------------------------------------------
# Schemas


def object_name(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    name = meta.get("name", "?")
    return f"{obj.get('kind', '?')} {namespace + '/' if namespace else ''}{name}"


def split_api_version(api_version: str) -> tuple[str, str]:
    if "/" in api_version:
        group, version = api_version.split("/", 1)
        return group, version
    return "", api_version


def is_builtin_group(group: str) -> bool:
    """Kubernetes' own API groups (core, apps, policy, ..., *.k8s.io), which the bundled
    schemas describe; anything else is a custom resource."""
    return group == "" or "." not in group or group.endswith(".k8s.io")


def error_lines(validator: jsonschema.protocols.Validator, obj: dict) -> list[str]:
    lines = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
        # For a failed anyOf/oneOf, the most relevant sub-error says more.
        best = jsonschema.exceptions.best_match([error])
        path = ".".join(str(p) for p in best.absolute_path) or "(top level)"
        line = f"{path}: {best.message}"
        if line not in lines:
            lines.append(line)
    return lines[:8]


class KubernetesSchemas:
    """The strict schemas of one Kubernetes version, as bundled by kubernetes-validate."""

    def __init__(self, version: str):
        import kubernetes_validate

        root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
        bundled = sorted(
            (p.name[1:].split("-")[0] for p in root.glob("v*-local-strict")),
            key=lambda v: tuple(int(x) for x in v.split(".")),
        )
        if not bundled:
            raise SystemExit(f"no schemas found in {root}")
        if version == "latest":
            version = bundled[-1]
        wanted = tuple(int(x) for x in version.split(".")[:2])
        matching = [v for v in bundled if tuple(int(x) for x in v.split(".")[:2]) == wanted]
        if not matching:
            raise SystemExit(
                f"kubernetes-validate bundles no schemas for Kubernetes {version} "
                f"(it has {bundled[0]} to {bundled[-1]})"
            )
        self.version = ".".join(matching[-1].split(".")[:2])
        self.directory = root / f"v{matching[-1]}-local-strict"
        definitions = json.loads((self.directory / "_definitions.json").read_text())
        self.registry = Resource.from_contents(definitions) @ Registry()
        self.validators: dict[str, jsonschema.protocols.Validator | None] = {}

    def validator(self, kind: str, group: str, version: str):
        file = f"{kind.lower()}-{group.split('.')[0] + '-' if group else ''}{version}.json"
        if file not in self.validators:
            path = self.directory / file
            if path.is_file():
                schema = json.loads(path.read_text())
                self.validators[file] = jsonschema.Draft202012Validator(
                    schema, registry=self.registry
                )
            else:
                self.validators[file] = None
        return self.validators[file]


class CustomSchemas:
    """JSON schemas of custom resources in k8s/schemas/, named <kind>-<group's first
    label>-<version>.json (scaledobject-keda-v1alpha1.json)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.validators: dict[str, jsonschema.protocols.Validator | None] = {}

    def validator(self, kind: str, group: str, version: str):
        file = f"{kind.lower()}-{group.split('.')[0]}-{version}.json"
        if file not in self.validators:
            path = self.directory / file
            if path.is_file():
                schema = json.loads(path.read_text())
                jsonschema.Draft202012Validator.check_schema(schema)
                self.validators[file] = jsonschema.Draft202012Validator(schema)
            else:
                self.validators[file] = None
        return self.validators[file], self.directory / file


def enumeration_problems(obj: dict) -> list[str]:
    kind = str(obj.get("kind", ""))
    rules = [(re.compile(p), allowed) for k, p, allowed in ENUMERATIONS if re.fullmatch(k, kind)]
    problems = []

    def walk(node, path):
        if isinstance(node, dict):
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            for pattern, allowed in rules:
                if pattern.search(path) and node not in allowed:
                    problems.append(f"{path}: {node!r} is not one of {', '.join(sorted(allowed))}")
            return
        for key, value in items:
            walk(value, f"{path}.{key}" if path else str(key))

    walk(obj, "")
    return problems


def check_schemas(
    obj: dict, kube: list[KubernetesSchemas], custom: CustomSchemas
) -> tuple[list[str], str]:
    """Problems of one object, and what it was checked against."""
    api_version = obj.get("apiVersion")
    kind = obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return ["apiVersion and kind must be strings"], "nothing"
    group, version = split_api_version(api_version)
    if is_builtin_group(group):
        versions: dict[str, list[str]] = {}  # problem -> the versions that have it
        for schemas in kube:
            validator = schemas.validator(kind, group, version)
            if validator is None:
                lines = [f"no {api_version} {kind} in this version (removed, misspelt or not "
                         "yet there)"]
            else:
                lines = error_lines(validator, obj)
            for line in lines:
                versions.setdefault(line, []).append(schemas.version)
        problems = [f"[Kubernetes {', '.join(v)}] {line}" for line, v in versions.items()]
        return problems + enumeration_problems(obj), \
            "Kubernetes " + ", ".join(s.version for s in kube)
    validator, path = custom.validator(kind, group, version)
    if validator is None:
        return [
            f"custom resource {api_version} {kind} has no schema: add {path.name} to "
            f"{custom.directory}"
        ], "nothing"
    return error_lines(validator, obj), str(path.name)


# ---------------------------------------------------------------------------------------------
# genfleet settings


def toml_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


def compatible(default, value) -> bool:
    want, have = toml_type(default), toml_type(value)
    return want == have or (want == "float" and have == "integer")


def check_settings_file(data: dict, defaults: dict) -> list[str]:
    """Keys of a settings file that genfleet would refuse."""
    problems = []
    for section, table in data.items():
        if section not in defaults:
            problems.append(f"unknown section [{section}] (known: {', '.join(defaults)})")
            continue
        if not isinstance(table, dict):
            problems.append(f"{section} must be a table")
            continue
        for key, value in table.items():
            if key not in defaults[section]:
                if section not in OPEN_SECTIONS:
                    problems.append(f"unknown key {section}.{key}")
            elif not compatible(defaults[section][key], value):
                problems.append(
                    f"{section}.{key} is a {toml_type(value)}; genfleet expects a "
                    f"{toml_type(defaults[section][key])}"
                )
    return problems


def parse_env_value(default, text: str):
    """What the settings make of an environment variable's text (the config crate's
    try_parsing: booleans, integers, floats, else a string), or None if it does not fit."""
    kind = toml_type(default)
    if kind == "string":
        return text
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.strip().lower())
    if kind == "integer":
        return int(text) if re.fullmatch(r"[+-]?[0-9]+", text.strip()) else None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------------------------------------
# Checks across the objects of one render


def matches(selector: dict | None, labels: dict | None) -> bool:
    """A selector against labels: a Service's plain map, or a LabelSelector (matchLabels and
    matchExpressions)."""
    labels = labels or {}
    selector = selector or {}
    if "matchLabels" in selector or "matchExpressions" in selector:
        match_labels = selector.get("matchLabels") or {}
    else:
        match_labels = selector
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def subcommand(container: dict) -> tuple[str | None, list[str]]:
    """genfleet's subcommand in a container (None if the container runs something else), and
    its arguments."""
    words = [str(w) for w in (container.get("command") or [])[1:] + (container.get("args") or [])]
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in GLOBAL_OPTIONS_WITH_VALUE:
            skip = True
            continue
        if word.startswith("-"):
            continue
        return word, words
    return None, words


def option_value(words: list[str], option: str) -> str | None:
    for index, word in enumerate(words):
        if word == option and index + 1 < len(words):
            return words[index + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


@dataclass
class MountedFile:
    kind: str  # "configMap", "secret", "emptyDir", ...
    name: str | None  # the ConfigMap's or Secret's name
    key: str | None  # the key in it (None: the path is a directory)


def mounted(path: str, container: dict, pod: dict) -> MountedFile | None:
    """What provides a path in a container, or None if no volume does."""
    best = None
    for mount in container.get("volumeMounts", []):
        mount_path = mount["mountPath"].rstrip("/")
        if path == mount_path or path.startswith(mount_path + "/"):
            if best is None or len(mount_path) > len(best["mountPath"].rstrip("/")):
                best = mount
    if best is None:
        return None
    volume = next((v for v in pod.get("volumes", []) if v.get("name") == best["name"]), None)
    if volume is None:
        return MountedFile("missing", None, None)
    relative = path[len(best["mountPath"].rstrip("/")):].lstrip("/")
    if best.get("subPath"):
        relative = best["subPath"] + ("/" + relative if relative else "")
    for kind, name_field in (("configMap", "name"), ("secret", "secretName")):
        if kind in volume:
            source = volume[kind]
            if not relative:
                return MountedFile(kind, source.get(name_field), None)
            items = source.get("items")
            if items:
                key = next((i["key"] for i in items if i.get("path") == relative), None)
                return MountedFile(kind, source.get(name_field), key or "")
            return MountedFile(kind, source.get(name_field), relative)
    return MountedFile(next(iter(k for k in volume if k != "name"), "?"), None, None)


@dataclass
class RenderReport:
    problems: list[str] = field(default_factory=list)
    secrets: dict[str, set] = field(default_factory=dict)  # Secret name -> keys expected
    pools: dict[str, dict] = field(default_factory=dict)  # Deployment name -> settings

    def problem(self, obj: dict | None, text: str):
        self.problems.append((object_name(obj) + ": " if obj else "") + text)


def check_render(objects: list[dict], defaults: dict, nats_servers: int | None) -> RenderReport:
    report = RenderReport()
    seen = set()
    for obj in objects:
        key = (obj.get("kind"), (obj.get("metadata") or {}).get("namespace"),
               (obj.get("metadata") or {}).get("name"))
        if key in seen:
            report.problem(obj, "defined twice")
        seen.add(key)

    def of_kind(kind):
        return [o for o in objects if o.get("kind") == kind]

    def named(kind, name, namespace):
        return next((o for o in of_kind(kind) if o["metadata"].get("name") == name
                     and o["metadata"].get("namespace") == namespace), None)

    workloads = [o for o in objects if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")]
    templates = [(w, w["spec"]["template"]) for w in workloads]
    autoscaled: dict[str, list[dict]] = {}

    for workload, template in templates:
        namespace = workload["metadata"].get("namespace")
        check_workload(workload, template, namespace, named, defaults, nats_servers, report)

    for service in of_kind("Service"):
        selector = service.get("spec", {}).get("selector")
        if not selector:
            continue
        namespace = service["metadata"].get("namespace")
        selected = [(w, t) for w, t in templates if w["metadata"].get("namespace") == namespace
                    and matches(selector, t["metadata"].get("labels"))]
        if not selected:
            report.problem(service, f"its selector {selector} matches no pod template")
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort")
            if isinstance(target, str):
                for workload, template in selected:
                    names = {p.get("name") for c in template["spec"]["containers"]
                             for p in c.get("ports", [])}
                    if target not in names:
                        report.problem(service, f"targetPort {target!r} is no port of "
                                                f"{object_name(workload)}")

    # Fields the schemas type as int-or-string, where the API server wants a count or "N%".
    for workload in of_kind("Deployment"):
        rolling = (workload["spec"].get("strategy") or {}).get("rollingUpdate") or {}
        for name in ("maxSurge", "maxUnavailable"):
            check_count_or_percent(workload, f"strategy.rollingUpdate.{name}", rolling.get(name),
                                   report)
    for budget in of_kind("PodDisruptionBudget"):
        for name in ("minAvailable", "maxUnavailable"):
            check_count_or_percent(budget, name, budget["spec"].get(name), report)
        if "minAvailable" in budget["spec"] and "maxUnavailable" in budget["spec"]:
            report.problem(budget, "sets both minAvailable and maxUnavailable (one at most)")
        namespace = budget["metadata"].get("namespace")
        selector = budget["spec"].get("selector")
        if not any(w["metadata"].get("namespace") == namespace
                   and matches(selector, t["metadata"].get("labels")) for w, t in templates):
            report.problem(budget, "its selector matches no pod template")

    for policy in of_kind("NetworkPolicy"):
        namespace = policy["metadata"].get("namespace")
        selector = policy["spec"].get("podSelector")
        selected = [(w, t) for w, t in templates if w["metadata"].get("namespace") == namespace
                    and matches(selector, t["metadata"].get("labels"))]
        if not selected:
            report.problem(policy, "its podSelector matches no pod template (a label typo?)")
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str):
                    for workload, template in selected:
                        names = {p.get("name") for c in template["spec"]["containers"]
                                 for p in c.get("ports", [])}
                        if port["port"] not in names:
                            report.problem(policy, f"ingress port {port['port']!r} is no port "
                                                   f"of {object_name(workload)}")

    for scaler in of_kind("HorizontalPodAutoscaler") + of_kind("ScaledObject"):
        namespace = scaler["metadata"].get("namespace")
        ref = scaler["spec"]["scaleTargetRef"]
        kind = ref.get("kind", "Deployment")
        target = named(kind, ref.get("name"), namespace)
        if target is None:
            report.problem(scaler, f"scales {kind} {ref.get('name')}, which is not here")
            continue
        autoscaled.setdefault(object_name(target), []).append(scaler)
        if "replicas" in target["spec"]:
            report.problem(target, f"sets spec.replicas although {object_name(scaler)} scales "
                                   "it: every apply would reset the count")
        if scaler["kind"] == "HorizontalPodAutoscaler":
            low, high = scaler["spec"].get("minReplicas", 1), scaler["spec"]["maxReplicas"]
            for metric in scaler["spec"].get("metrics", []):
                resource = metric.get("resource", {})
                if metric.get("type") == "Resource" and \
                        resource.get("target", {}).get("type") == "Utilization":
                    name = resource.get("name")
                    for container in target["spec"]["template"]["spec"]["containers"]:
                        if name not in container.get("resources", {}).get("requests", {}):
                            report.problem(scaler, f"scales on {name} utilization but container "
                                                   f"{container['name']} requests no {name}")
        else:
            low = scaler["spec"].get("minReplicaCount", 0)
            high = scaler["spec"].get("maxReplicaCount", 100)
            check_keda_triggers(scaler, target, named, report)
        if low > high:
            report.problem(scaler, f"minimum replicas {low} above maximum {high}")
    for name, scalers in autoscaled.items():
        if len(scalers) > 1:
            report.problems.append(f"{name}: scaled by " +
                                   " and ".join(object_name(s) for s in scalers))
    return report


def check_count_or_percent(obj, where, value, report):
    if isinstance(value, str) and not re.fullmatch(r"[0-9]+%", value):
        report.problem(obj, f"{where} {value!r} is neither a number nor a percentage")


def check_workload(workload, template, namespace, named, defaults, nats_servers, report):
    pod = template["spec"]
    labels = template["metadata"].get("labels")
    if not matches(workload["spec"].get("selector"), labels):
        report.problem(workload, "spec.selector does not match the pod template's labels")
    account = pod.get("serviceAccountName")
    if account and account != "default" and named("ServiceAccount", account, namespace) is None:
        report.problem(workload, f"ServiceAccount {account} is not here")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for volume in volumes.values():
        if "configMap" in volume and \
                named("ConfigMap", volume["configMap"]["name"], namespace) is None:
            report.problem(workload, f"volume {volume['name']}: ConfigMap "
                                     f"{volume['configMap']['name']} is not here")
        if "secret" in volume:
            secret = volume["secret"]
            keys = report.secrets.setdefault(secret["secretName"], set())
            keys.update(i["key"] for i in secret.get("items", []))
    for container in pod.get("initContainers", []) + pod["containers"]:
        where = f"container {container.get('name')}"
        if not container.get("image"):
            report.problem(workload, f"{where} has no image (a patch naming a container that "
                                     "does not exist adds one like this)")
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                report.problem(workload, f"{where} mounts volume {mount['name']}, which the pod "
                                         "does not have")
        ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
        for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(probe_name) or {}
            port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                report.problem(workload, f"{where}: {probe_name} uses port {port!r}, which the "
                                         "container does not declare")
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                if named("Secret", ref["name"], namespace) is None:
                    report.secrets.setdefault(ref["name"], set()).add(ref["key"])
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                config_map = named("ConfigMap", ref["name"], namespace)
                if config_map is None or ref["key"] not in (config_map.get("data") or {}):
                    report.problem(workload, f"{where}: env {env['name']} reads ConfigMap "
                                             f"{ref['name']} key {ref['key']}, which is not here")
        command, words = subcommand(container)
        if "genfleet" in str(container.get("image", "")).rsplit("/", 1)[-1] and command:
            check_genfleet(workload, pod, container, command, words, named, namespace, defaults,
                           nats_servers, report)
    # Secrets generated in this render need no creating.
    for name in list(report.secrets):
        if named("Secret", name, namespace) is not None:
            del report.secrets[name]


def check_genfleet(workload, pod, container, command, words, named, namespace, defaults,
                   nats_servers, report):
    """genfleet's settings as this container will load them, and what they imply."""
    where = f"container {container['name']} (genfleet {command})"

    def problem(text):
        report.problem(workload, f"{where}: {text}")

    def read_mounted(path: str, what: str) -> str | None:
        """The content of a mounted file when a ConfigMap holds it; None otherwise."""
        source = mounted(path, container, pod)
        if source is None:
            problem(f"{what} {path} is on no mounted volume")
            return None
        if source.kind == "configMap":
            config_map = named("ConfigMap", source.name, namespace)
            if config_map is None:
                return None  # reported with the volume
            if source.key is None:
                return None
            data = config_map.get("data") or {}
            if source.key not in data:
                problem(f"{what} {path}: ConfigMap {source.name} has no key "
                        f"{source.key or '(not among the items)'}")
                return None
            return data[source.key]
        if source.kind == "secret":
            if source.key:
                report.secrets.setdefault(source.name, set()).add(source.key)
            elif source.key == "":
                problem(f"{what} {path}: not among the Secret volume's items")
            return None
        problem(f"{what} {path} is on a {source.kind} volume, which starts empty")
        return None

    settings = json.loads(json.dumps(defaults))  # a deep copy
    env = {e["name"]: e for e in container.get("env", [])}
    config_path = option_value(words, "--config") or (env.get("GENFLEET_CONFIG") or {}).get("value")
    if config_path:
        text = read_mounted(config_path, "the settings file")
        if text is not None:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                problem(f"the settings file {config_path} is not valid TOML: {error}")
                data = {}
            for line in check_settings_file(data, defaults):
                problem(f"settings file {config_path}: {line}")
            for section, table in data.items():
                if isinstance(table, dict) and section in settings:
                    for key, value in table.items():
                        if key in settings[section]:
                            settings[section][key] = value
    for name, entry in env.items():
        if name.startswith("GENFLEET__"):
            parts = name[len("GENFLEET__"):].lower().split("__")
            if len(parts) == 2 and parts[0] in OPEN_SECTIONS and parts[0] in defaults \
                    and parts[1] not in defaults[parts[0]]:
                continue
            if len(parts) != 2 or parts[0] not in defaults or parts[1] not in defaults[parts[0]]:
                problem(f"env {name} names no setting (GENFLEET__SECTION__KEY, keys as in "
                        "config/default.toml)")
                continue
            section, key = parts
            if "value" in entry:
                value = parse_env_value(defaults[section][key], str(entry["value"]))
                if value is None:
                    problem(f"env {name}={entry['value']!r} is no "
                            f"{toml_type(defaults[section][key])}")
                else:
                    settings[section][key] = value
            else:
                settings[section][key] = "<from " + ", ".join(entry.get("valueFrom", {})) + ">"
        elif name.startswith("GENFLEET_") and name != "GENFLEET_CONFIG":
            problem(f"env {name} is read by nothing (settings take two underscores: "
                    "GENFLEET__SECTION__KEY)")

    for section, key in sorted(PATH_SETTINGS):
        value = settings.get(section, {}).get(key)
        if isinstance(value, str) and value and not value.startswith("<from"):
            read_mounted(value, f"{section}.{key}")
    if nats_servers is not None and settings["jetstream"]["replicas"] > nats_servers:
        problem(f"jetstream.replicas = {settings['jetstream']['replicas']} but the NATS cluster "
                f"of k8s/nats/values.yaml has {nats_servers} servers")

    if command == "worker":
        listen = settings["http"]["listen"]
        if not listen:
            problem("http.listen is empty: no /healthz, /readyz or /metrics for the probes")
        else:
            port = int(listen.rsplit(":", 1)[1])
            ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
            if ports.get("http") != port:
                problem(f"http.listen is {listen} but the container port named http is "
                        f"{ports.get('http')}")
            for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                probe = (container.get(probe_name) or {}).get("httpGet") or {}
                if probe.get("path") != path or probe.get("port") not in ("http", port):
                    problem(f"{probe_name} should be an HTTP GET of {path} on the http port")
        drain = settings["worker"]["drain_timeout_ms"] / 1000
        cancel = settings["worker"]["cancel_wait_ms"] / 1000
        pause = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}) \
            .get("seconds", 0)
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace < pause + drain + cancel + FLUSH_SECONDS:
            problem(f"terminationGracePeriodSeconds {grace} is too short to drain: it must be at "
                    f"least the preStop pause ({pause} s) + worker.drain_timeout_ms ({drain:g} s)"
                    f" + worker.cancel_wait_ms ({cancel:g} s) + {FLUSH_SECONDS} s of flush")
        report.pools[workload["metadata"]["name"]] = settings
    if command == "gateway":
        listen = option_value(words, "--listen") or settings.get("gateway", {}).get("listen", "")
        port = int(listen.rsplit(":", 1)[1]) if ":" in listen else None
        ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
        if listen.startswith("127.") or listen.startswith("[::1]") or listen.startswith("localhost"):
            problem(f"the gateway listens on {listen}, loopback: the Service cannot reach it")
        if ports.get("http") != port:
            problem(f"the gateway listens on {listen} but the container port named http is "
                    f"{ports.get('http')}")
        for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            probe = (container.get(probe_name) or {}).get("httpGet") or {}
            if probe.get("path") != path or probe.get("port") not in ("http", port):
                problem(f"{probe_name} should be an HTTP GET of {path} on the http port")
    if command == "manager":
        rules = option_value(words, "--rules") or settings["manager"]["rules_file"]
        if rules and not rules.startswith("<from"):
            text = read_mounted(rules, "the rules file")
            if text is not None:
                for line in check_rules(text):
                    problem(f"rules file {rules}: {line}")


def check_rules(text: str) -> list[str]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        return [f"not valid TOML: {error}"]
    problems = [f"unknown top-level key {k!r} (only [[rule]] tables)" for k in data if k != "rule"]
    for number, rule in enumerate(data.get("rule", []), start=1):
        unknown = sorted(set(rule) - MANAGER_RULE_KEYS)
        if unknown:
            problems.append(f"rule {number}: unknown key(s) {', '.join(unknown)}")
        if ("answer" in rule) == ("action" in rule):
            problems.append(f"rule {number}: needs exactly one of answer and action")
    return problems


# The fields of a worker's GET /scaling that KEDA's metrics-api scaler may scale on
# (docs/operations.md#autoscaling): the pool's, the same on every worker.
SCALING_FIELDS = {"workers", "slots", "slots_busy", "queue_waiting", "queue_running", "backlog",
                  "wanted_slots"}
# ... and of a gateway's: the replica's own.
GATEWAY_SCALING_FIELDS = {"open_responses"}


def runs_gateway(target) -> bool:
    return any(subcommand(c)[0] == "gateway"
               for c in target["spec"]["template"]["spec"]["containers"])


def check_keda_triggers(scaler, target, named, report):
    settings = report.pools.get(target["metadata"]["name"])
    for trigger in scaler["spec"].get("triggers", []):
        if trigger.get("type") == "metrics-api":
            if settings is not None:
                check_scaling_trigger(scaler, target, trigger, settings, named, report)
            elif runs_gateway(target):
                check_scaling_trigger(scaler, target, trigger, None, named, report)
        if trigger.get("type") != "nats-jetstream" or settings is None:
            continue
        metadata = trigger.get("metadata", {})
        stream = settings["jetstream"]["queue_stream"]
        consumer = "genfleet-" + str(settings["worker"]["pool"])
        if metadata.get("stream") != stream:
            report.problem(scaler, f"nats-jetstream trigger: stream must be {stream!r} (the "
                                   f"workers' jetstream.queue_stream), not "
                                   f"{metadata.get('stream')!r}")
        if metadata.get("consumer") != consumer:
            report.problem(scaler, f"nats-jetstream trigger: consumer must be {consumer!r} (the "
                                   f"durable consumer of pool {settings['worker']['pool']!r}), "
                                   f"not {metadata.get('consumer')!r}")


def check_scaling_trigger(scaler, target, trigger, settings, named, report):
    """A metrics-api trigger on /scaling: a Service of this render that selects the scaled
    pods, on a port of it, a field /scaling has. For workers (`settings`: their pool's), a
    Service of that pool's ready workers only, and targets that make the pool grow; for the
    gateway (`settings` None), whose replicas each tell their own count, metricType Value."""
    metadata = trigger.get("metadata", {})
    gateway = settings is None

    def problem(text):
        report.problem(scaler, "metrics-api trigger: " + text)

    if gateway and trigger.get("metricType") != "Value":
        problem("a gateway replica tells its own open responses, not the sum over replicas: "
                "metricType must be Value")

    match = re.fullmatch(r"https?://([^/:]+)(?::([0-9]+))?(/.*)?", metadata.get("url", ""))
    if not match:
        return  # the schema says why
    host, port, path = match.group(1), match.group(2), match.group(3) or "/"
    if path != "/scaling":
        problem(f"url path {path!r}: the workers serve their pool's signals at /scaling")
    parts = host.split(".")
    namespace = target["metadata"].get("namespace")
    if len(parts) < 2 or parts[1] != namespace:
        problem(f"url host {host!r} is not <service>.{namespace}[.svc...]: KEDA's operator runs "
                "in its own namespace and needs the Service's namespace in the name")
    else:
        service = named("Service", parts[0], namespace)
        if service is None:
            problem(f"url names Service {parts[0]!r}, which is not here")
        else:
            selector = service["spec"].get("selector") or {}
            labels = target["spec"]["template"]["metadata"].get("labels", {})
            if not matches(selector, labels):
                problem(f"Service {parts[0]} does not select the pods of "
                        f"{object_name(target)}")
            pool_label = "genfleet.io/pool"
            if not gateway and selector.get(pool_label) != labels.get(pool_label):
                problem(f"Service {parts[0]} must select {pool_label}="
                        f"{labels.get(pool_label)!r}: a worker of another pool measures "
                        "another pool")
            ports = {str(p.get("port")) for p in service["spec"].get("ports", [])}
            if (port or ("443" if metadata["url"].startswith("https") else "80")) not in ports:
                problem(f"url port {port} is no port of Service {parts[0]} ({sorted(ports)})")
            if not gateway and service["spec"].get("publishNotReadyAddresses"):
                problem(f"Service {parts[0]} publishes workers that are not ready: one cut off "
                        "from NATS would answer for the pool")
    location = metadata.get("valueLocation")
    fields = GATEWAY_SCALING_FIELDS if gateway else SCALING_FIELDS
    if location not in fields:
        problem(f"valueLocation {location!r} is no field of /scaling "
                f"({', '.join(sorted(fields))})")
    if metadata.get("format", "json") != "json":
        problem("/scaling answers JSON: format must be json (or left out)")
    try:
        target_value = float(metadata.get("targetValue", ""))
    except ValueError:
        return  # the schema says why
    if target_value <= 0:
        problem("targetValue must be above 0")
        return
    if gateway:
        return
    slots = settings["worker"]["slots"]
    if target_value <= 0:
        problem("targetValue must be above 0")
    elif location == "slots_busy" and target_value >= slots:
        problem(f"targetValue {metadata['targetValue']} on slots_busy must be below "
                f"worker.slots ({slots}): a pool whose every slot is busy would not grow")
    elif location in ("wanted_slots", "backlog") and target_value > slots:
        problem(f"targetValue {metadata['targetValue']} on {location} is above worker.slots "
                f"({slots}): the pool would stay smaller than what waits for it")


# ---------------------------------------------------------------------------------------------
# The NATS Helm values


def check_nats_values(path: Path) -> tuple[list[str], int | None]:
    """Problems of the values file, and the number of NATS servers it makes."""
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        return [f"not valid YAML: {error}"], None
    if not isinstance(values, dict):
        return ["must be a mapping"], None
    problems = [f"unknown top-level key {k!r} (the chart has: "
                f"{', '.join(sorted(NATS_CHART_TOP_LEVEL_KEYS))})"
                for k in values if k not in NATS_CHART_TOP_LEVEL_KEYS]
    config = values.get("config") or {}

    def get(*keys):
        node = config
        for key in keys:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node

    if get("jetstream", "enabled") is not True:
        problems.append("config.jetstream.enabled must be true: genfleet keeps its queue, "
                        "results and decisions in JetStream")
    if get("jetstream", "fileStore", "enabled") is False:
        problems.append("config.jetstream.fileStore.enabled must not be false: genfleet's "
                        "streams and buckets use file storage")
    if get("monitor", "enabled") is not True:
        problems.append("config.monitor.enabled must be true: KEDA reads the monitoring port")
    servers = 1
    if get("cluster", "enabled"):
        servers = get("cluster", "replicas") or 3
        if servers < 3:
            problems.append(f"config.cluster.replicas is {servers}: a JetStream cluster needs 3 "
                            "servers to keep a quorum when one is lost")
    return problems, servers


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubectl", required=True, help="kubectl to run `kubectl kustomize`")
    parser.add_argument("--kube-versions", default="1.30,latest",
                        help="Kubernetes versions to validate against (latest: the newest "
                             "bundled)")
    parser.add_argument("--repo", default=Path(__file__).resolve().parent.parent, type=Path)
    parser.add_argument("directories", nargs="*", type=Path,
                        help="kustomizations to check (each with those under it); default: k8s/")
    args = parser.parse_args()
    repo = args.repo.resolve()
    k8s = repo / "k8s"
    defaults = tomllib.loads((repo / "config" / "default.toml").read_text())

    kube = [KubernetesSchemas(v.strip()) for v in args.kube_versions.split(",") if v.strip()]
    custom = CustomSchemas(k8s / "schemas")
    failures: list[tuple[str, str]] = []  # (where, problem)

    values = k8s / "nats" / "values.yaml"
    print(f"==> {values.relative_to(repo)}: the NATS Helm chart's values")
    problems, nats_servers = check_nats_values(values)
    failures += [(str(values.relative_to(repo)), p) for p in problems]
    print(f"    {'ok' if not problems else str(len(problems)) + ' problem(s)'}: YAML, chart keys, "
          f"JetStream on file storage, monitoring, {nats_servers} server(s)")

    targets = []
    for root in args.directories or [k8s]:
        if not root.is_dir():
            raise SystemExit(f"{root} is not a directory")
        found = find_targets(root.resolve(), k8s / "base", Path.cwd())
        if not found:
            raise SystemExit(f"no kustomization in {root}")
        targets += found
    total = 0
    for target in targets:
        print(f"==> {target.label}")
        objects, error = render(args.kubectl, target)
        if error:
            failures.append((target.label, error))
            print(f"    render FAILED: {error}")
            continue
        total += len(objects)
        counted: dict[str, int] = {}
        for obj in objects:
            counted[obj.get("kind", "?")] = counted.get(obj.get("kind", "?"), 0) + 1
        print(f"    rendered {len(objects)} objects: " +
              ", ".join(f"{n} {k}" for k, n in counted.items()))
        against = set()
        bad = 0
        for obj in objects:
            problems, checked = check_schemas(obj, kube, custom)
            against.add(checked)
            for line in problems:
                failures.append((target.label, f"{object_name(obj)}: {line}"))
            bad += bool(problems)
        print(f"    schemas ({'; '.join(sorted(against))}, strict): "
              f"{'ok' if not bad else str(bad) + ' invalid object(s)'}")
        try:
            report = check_render(objects, defaults, nats_servers)
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            # Objects malformed enough to break these checks fail their schemas too.
            report = RenderReport()
            if not bad:
                raise
            report.problems.append(f"references and settings not checked: objects are "
                                   f"malformed ({type(error).__name__}: {error})")
        failures += [(target.label, p) for p in report.problems]
        print(f"    references and genfleet settings: "
              f"{'ok' if not report.problems else str(len(report.problems)) + ' problem(s)'}")
        if report.secrets:
            print("    expects Secrets: " + ", ".join(
                f"{name} ({', '.join(sorted(keys)) or 'any keys'})"
                for name, keys in sorted(report.secrets.items())))

    print()
    if failures:
        # A problem of the base shows in every render built on it: say it once, with where.
        where: dict[str, list[str]] = {}
        for label, line in failures:
            labels = where.setdefault(line, [])
            if label not in labels:
                labels.append(label)
        print(f"INVALID: {len(where)} problem(s):", file=sys.stderr)
        for line, labels in where.items():
            print(f"  {line}\n      in {', '.join(labels)}", file=sys.stderr)
        return 1
    print(f"k8s manifests valid: {len(targets)} renders, {total} objects, Kubernetes "
          f"{', '.join(s.version for s in kube)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
