"""The request path compiled with mypyc, where mypyc is importable.

`make install` runs `setup.py build_ext --inplace` in the project's venv (mypy is a test
dependency), which puts one extension module beside each source listed in native.txt.
Where mypy is absent (pip's isolated build environment, a plain `pip install .`) or
SERVEGATE_PURE=1 is set, the package builds as plain Python: the same code, slower.
"""

import os
from pathlib import Path

from setuptools import setup


def native_sources() -> list[str]:
    listing = (Path(__file__).parent / "native.txt").read_text().splitlines()
    return [f"src/{line.strip()}" for line in listing if line.strip() and not line.startswith("#")]


def ext_modules() -> list[object]:
    if os.environ.get("SERVEGATE_PURE") == "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    return list(mypycify(native_sources(), opt_level="3"))


setup(ext_modules=ext_modules())
