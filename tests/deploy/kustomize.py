"""The subset of kustomize that deploy/ uses, so its builds render without a kubectl binary.

No PyPI package renders kustomizations (the `kustomize` package is unrelated and
`pykustomize` needs Python 3.14), so this implements what deploy/ uses and refuses
everything else by name, so a new field in a kustomization fails here first:

- `resources`: files (YAML streams) and folders holding a kustomization.yaml
- `configMapGenerator`: `files` (`path` or `key=path`), `literals`, `options.labels`,
  `behavior: create|replace|merge`; only with `generatorOptions.disableNameSuffixHash`
- `patches`: strategic-merge patch files, matched by kind and name; lists of maps
  merge by `name`, other lists are replaced
- `images` (`name` → `newName`/`newTag`), `namespace` (also ServiceAccount subjects),
  `labels` with `includeSelectors: false` (metadata labels only)

Like kustomize, files must lie inside the kustomization's folder.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN = {
    "apiVersion",
    "kind",
    "resources",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "images",
    "namespace",
    "labels",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "APIService",
    "PriorityClass",
    "StorageClass",
    "PersistentVolume",
}
Resource = dict[str, Any]


class KustomizeError(Exception):
    pass


def _inside(root: Path, relative: str) -> Path:
    path = (root / relative).resolve()
    if root.resolve() not in path.parents and path != root.resolve():
        raise KustomizeError(f"{root}: {relative} is outside the kustomization's folder")
    if not path.exists():
        raise KustomizeError(f"{root}: {relative} does not exist")
    return path


def load_yaml_stream(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _key(resource: Resource) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


def strategic_merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in base + patch)
    ):
        merged = [copy.deepcopy(i) for i in base]
        index = {item["name"]: n for n, item in enumerate(merged)}
        for item in patch:
            if item["name"] in index:
                merged[index[item["name"]]] = strategic_merge(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _config_map(root: Path, gen: dict[str, Any]) -> Resource:
    unknown = set(gen) - {"name", "files", "literals", "options", "behavior"}
    if unknown:
        raise KustomizeError(f"{root}: configMapGenerator fields not supported: {sorted(unknown)}")
    data: dict[str, str] = {}
    for spec in gen.get("files", []):
        key, sep, rel = spec.partition("=")
        if not sep:
            key, rel = Path(spec).name, spec
        data[key] = _inside(root, rel).read_text()
    for literal in gen.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    metadata: dict[str, Any] = {"name": gen["name"]}
    labels = gen.get("options", {}).get("labels")
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _containers(resource: Resource) -> list[dict[str, Any]]:
    spec = resource.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else {}
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def _image_name(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def build(root: Path) -> list[Resource]:
    """Render the kustomization in `root` to its list of resources."""
    doc = yaml.safe_load((root / "kustomization.yaml").read_text()) or {}
    unknown = set(doc) - KNOWN
    if unknown:
        raise KustomizeError(f"{root}: kustomization fields not supported: {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in doc.get("resources", []):
        path = (root / entry).resolve()
        if path.is_dir():
            if not (path / "kustomization.yaml").exists():
                raise KustomizeError(f"{root}: {entry} has no kustomization.yaml")
            resources.extend(build(path))
        else:
            resources.extend(load_yaml_stream(_inside(root, entry)))

    generators = doc.get("configMapGenerator", [])
    if generators and not doc.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{root}: name-suffix hashes are not implemented; disable them")
    for gen in generators:
        made = _config_map(root, gen)
        behavior = gen.get("behavior", "create")
        existing = [r for r in resources if _key(r) == ("ConfigMap", gen["name"])]
        if behavior == "create":
            if existing:
                raise KustomizeError(f"{root}: ConfigMap {gen['name']} already exists")
            resources.append(made)
        elif behavior in ("replace", "merge"):
            if not existing:
                raise KustomizeError(f"{root}: no ConfigMap {gen['name']} to {behavior}")
            target = existing[0]
            if behavior == "replace":
                target["data"] = made["data"]
            else:
                target["data"] = {**target.get("data", {}), **made["data"]}
        else:
            raise KustomizeError(f"{root}: unknown generator behavior {behavior!r}")

    for patch in doc.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{root}: only `patches: [{{path: ...}}]` is supported")
        for body in load_yaml_stream(_inside(root, patch["path"])):
            matches = [n for n, r in enumerate(resources) if _key(r) == _key(body)]
            if len(matches) != 1:
                raise KustomizeError(
                    f"{root}: patch {patch['path']} matches {len(matches)} resources"
                )
            resources[matches[0]] = strategic_merge(resources[matches[0]], body)

    for image in doc.get("images", []):
        for resource in resources:
            for container in _containers(resource):
                if _image_name(container["image"]) == image["name"]:
                    tag = image.get("newTag")
                    container["image"] = image.get("newName", image["name"]) + (
                        f":{tag}" if tag else ""
                    )

    namespace = doc.get("namespace")
    if namespace:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = namespace
            for subject in resource.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace

    for label in doc.get("labels", []):
        if label.get("includeSelectors", False) or set(label) - {"pairs", "includeSelectors"}:
            raise KustomizeError(f"{root}: only `labels` with includeSelectors: false is supported")
        for resource in resources:
            resource["metadata"].setdefault("labels", {}).update(label["pairs"])

    seen: set[tuple[str, str, str]] = set()
    for resource in resources:
        ident = (*_key(resource), resource["metadata"].get("namespace", ""))
        if ident in seen:
            raise KustomizeError(f"{root}: {ident} is defined twice")
        seen.add(ident)
    return resources
