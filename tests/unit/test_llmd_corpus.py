"""Every EndpointPickerConfig of llm-d's own repositories, through servegate's real loader.

The corpus lives outside the repository (`../shared/llm-d-configs/`, see its
README); CI has it, so a missing folder fails there and is skipped elsewhere.
Each file is one test case, loaded the way `servegate config check` loads it:
a servegate config naming the file as `picker:`, then `build_gateway`.

- A *valid* file (not a loader `__error` fixture, no test-only plugin type, no
  placeholder) must load.
- A loader fixture whose name contains `__error` must be rejected, as upstream
  rejects it.
- `LATENCY` lists the valid files that wait only on the latency-predictor types of
  issue 21 (another branch); `REFUSED` the files servegate refuses on purpose, each
  with why; `GAPS` valid files servegate cannot load yet. All three are strict:
  a listed file that starts loading fails the run until it is taken off its list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from servegate.config import ConfigError, parse_config
from servegate.gateway.app import build_gateway
from servegate.scheduling.config import PickerConfigError

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "llm-d-configs"
TEST_ONLY = re.compile(
    r"header-based-testing-filter|mock-metrics-source|destination-endpoint-served-verifier"
    r"|custom-scorer|type:\s*['\"]?test-|\.\.\.\."
)
"""What the corpus README names as not a real configuration."""

LATENCY_TYPES = (
    "latency-scorer",
    "slo-headroom-tier-filter",
    "latency-slo-admitter",
    "predicted-latency-producer",
    "predicted-latency-scorer",
)
"""Types issue 21 (the latency predictor) provides (`predicted-latency-scorer` is the
Gateway API Inference Extension v1.5 name of `latency-scorer`); files needing them wait
for it. The coordinator empties `LATENCY` after merging that branch."""

LATENCY: frozenset[str] = frozenset()

REFUSED: dict[str, str] = {
    "current/router__test_integration_epp_session_affinity_test.go__pdConfigBase.yaml": (
        "a Go format template cut at its `%s`: disagg-profile-handler without parameters and "
        "no schedulingProfiles, so no `decode` profile exists and no request could ever be "
        "routed; llm-d loads it and fails every request, servegate refuses it at load"
    ),
    "older/gie__site-src_guides_epp-configuration_config-text.md__3.yaml": (
        "a documentation placeholder: `schedulingProfiles: ... ...`"
    ),
    "v0.7/sched071__docs_architecture.md__2.yaml": (
        "a documentation snippet without apiVersion; llm-d's loader (Kubernetes decoding) "
        "refuses it too"
    ),
}

GAPS: frozenset[str] = frozenset()


def _kind(path: Path) -> str:
    if "__error" in path.name:
        return "error"
    if TEST_ONLY.search(path.read_text()):
        return "test-only"
    return "valid"


def _corpus() -> Iterator[tuple[str, Path]]:
    if not CORPUS.is_dir():
        return
    for folder in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            yield f"{folder.name}/{path.name}", path


FILES = list(_corpus())
REFUSALS = (ConfigError, PickerConfigError, KeyError, ValueError)
"""What `servegate config check` reports as a refused config (anything else is a crash)."""


def load(path: Path) -> None:
    """What `servegate config check` does with a config whose `picker:` is `path`."""
    cfg = parse_config(f"picker: {path}\n", "<corpus>")
    build_gateway(cfg, path.parent)


def test_corpus_is_present() -> None:
    if not CORPUS.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"the llm-d config corpus is missing at {CORPUS}; CI must provide it")
        pytest.skip(f"no llm-d config corpus at {CORPUS}")
    assert len(FILES) > 250
    listed = {key for key, _ in FILES}
    assert listed >= GAPS, sorted(GAPS - listed)
    assert listed >= LATENCY, sorted(LATENCY - listed)
    assert listed >= set(REFUSED), sorted(set(REFUSED) - listed)
    assert not GAPS & LATENCY and not (GAPS | LATENCY) & set(REFUSED)


@pytest.mark.parametrize(("key", "path"), FILES, ids=[key for key, _ in FILES])
def test_corpus_file(key: str, path: Path) -> None:
    kind = _kind(path)
    if kind == "test-only":
        assert key not in GAPS and key not in LATENCY and key not in REFUSED
        return
    if kind == "error":
        with pytest.raises(REFUSALS) as caught:
            load(path)
        assert str(caught.value)
        return
    if key in LATENCY:
        with pytest.raises(REFUSALS) as caught:
            load(path)
        assert any(t in str(caught.value) for t in LATENCY_TYPES), caught.value
        pytest.xfail("waits for the latency predictor's types (issue 21)")
    if key in REFUSED or key in GAPS:
        with pytest.raises(REFUSALS):
            load(path)
        pytest.xfail(REFUSED.get(key, "listed in GAPS: not loadable yet"))
    load(path)


def _counts() -> dict[str, tuple[int, int, int, int, int]]:
    """Per folder: files, valid, loading, waiting for issue 21, refused on purpose.

    `loading` follows from the lists: `test_corpus_file` checks that every valid file
    loads unless listed, and that every listed one does not."""
    out: dict[str, list[int]] = {}
    for key, path in FILES:
        row = out.setdefault(key.split("/")[0], [0, 0, 0, 0, 0])
        row[0] += 1
        if _kind(path) != "valid":
            continue
        row[1] += 1
        row[2] += key not in LATENCY and key not in REFUSED and key not in GAPS
        row[3] += key in LATENCY
        row[4] += key in REFUSED
    return {folder: (a, b, c, d, e) for folder, (a, b, c, d, e) in out.items()}


def test_the_docs_state_the_measured_counts() -> None:
    if not CORPUS.is_dir():
        pytest.skip(f"no llm-d config corpus at {CORPUS}")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    for folder, (files, valid, loading, latency, refused) in _counts().items():
        row = f"| `{folder}/` | {files} | {valid} | **{loading}** | {latency} | {refused} |"
        assert row in docs, row
