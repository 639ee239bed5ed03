"""Every EndpointPickerConfig of llm-d's own repositories, through servegate's real loader.

The corpus lives outside the repository (`../shared/llm-d-configs/`, see its
README); CI has it, so a missing folder fails there and is skipped elsewhere.
Each file is one test case, loaded the way `servegate config check` loads it:
a servegate config naming the file as `picker:`, then `build_gateway`.

- A *valid* file (not a loader `__error` fixture, no test-only plugin type, no
  placeholder) must load.
- A loader fixture whose name contains `__error` must be rejected, as upstream
  rejects it.
- `GAPS` lists valid files servegate cannot load yet, each with the first
  reason; they are strict xfails, so one that starts loading fails the run
  until it is taken off the list. `LATENCY` lists the files that wait only on
  the latency-predictor types of issue 21.
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
)
"""Types issue 21 (the latency predictor) provides; files needing them wait for it."""

LATENCY: frozenset[str] = frozenset()

GAPS: frozenset[str] = frozenset(
    {
        "current/router__cmd_epp_runner_feature_gate_test.go__ConfigText.yaml",
        "current/router__deploy_config_epp-burst-prefix-cache-config.yaml__0.yaml",
        "current/router__deploy_config_epp-mm-embeddings-cache-config.yaml__0.yaml",
        "current/router__deploy_config_epp-precise-prefix-cache-config.yaml__0.yaml",
        "current/router__deploy_config_pd-epp-config.yaml__0.yaml",
        "current/router__deploy_config_pd-topology-epp-config.yaml__0.yaml",
        "current/router__deploy_config_probabilistic-admitter-epp-config.yaml__0.yaml",
        "current/router__deploy_config_sim-e-p-d-epp-config.yaml__0.yaml",
        "current/router__deploy_config_sim-e-pd-epp-config.yaml__0.yaml",
        "current/router__deploy_config_sim-epp-config.yaml__0.yaml",
        "current/router__deploy_config_sim-epp-gpu-config.yaml__0.yaml",
        "current/router__deploy_config_sim-epp-kvcache-config.yaml__0.yaml",
        "current/router__deploy_config_sim-epp-no-hit-lru.yaml__0.yaml",
        "current/router__deploy_config_sim-epp-tokenizer-vllm-http-config.yaml__0.yaml",
        "current/router__deploy_config_sim-pd-epp-config.yaml__0.yaml",
        "current/router__deploy_config_sim-program-aware-config.yaml__0.yaml",
        "current/router__deploy_config_soft-reflective-ceiling-epp-config.yaml__0.yaml",
        "current/router__docs_architecture.md__1.yaml",
        "current/router__docs_disaggregation.md__0.yaml",
        "current/router__docs_disaggregation.md__1.yaml",
        "current/router__pkg_epp_framework_plugins_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_datalayer_extractor_dcgm_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_datalayer_source_dcgm_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_datalayer_source_models_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requestcontrol_admitter_probabilisticadmitter_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requestcontrol_requestattributereporter_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requestcontrol_requestheader_agentidentity_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requestcontrol_requestheader_agentidentity_README.md__1.yaml",
        "current/router__pkg_epp_framework_plugins_requestcontrol_screener_disaggregatedsetrollout_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requesthandling_parsers_README.md__0.yaml",
        "current/router__pkg_epp_framework_plugins_requesthandling_parsers_README.md__1.yaml",
        "current/router__pkg_epp_framework_plugins_requesthandling_parsers_README.md__2.yaml",
        "current/router__pkg_epp_framework_plugins_requesthandling_parsers_vertexai_README.md__0.yaml",
        "current/router__test_coordinator_e2e_coordinator_configs_test.go__eppConfig.yaml",
        "current/router__test_coordinator_e2e_coordinator_configs_test.go__eppConfigLeastBusy.yaml",
        "current/router__test_coordinator_e2e_coordinator_configs_test.go__eppConfigPrefill.yaml",
        "current/router__test_e2e_configs_test.go__decodeOnlyConfig.yaml",
        "current/router__test_e2e_configs_test.go__decodeOnlyConfig_.yaml",
        "current/router__test_e2e_configs_test.go__decodeOnlyConfig__.yaml",
        "current/router__test_e2e_configs_test.go__deprecatedPdConfig.yaml",
        "current/router__test_e2e_configs_test.go__epdConfig.yaml",
        "current/router__test_e2e_configs_test.go__epdEncodeDecodeConfig.yaml",
        "current/router__test_e2e_configs_test.go__generateEncodeConfig.yaml",
        "current/router__test_e2e_configs_test.go__generatePrefillConfig.yaml",
        "current/router__test_e2e_configs_test.go__pdConfig.yaml",
        "current/router__test_e2e_configs_test.go__simpleConfig.yaml",
        "current/router__test_integration_epp_e2e_config_smoke_test.go__2.yaml",
        "current/router__test_integration_epp_e2e_config_smoke_test.go__4.yaml",
        "current/router__test_integration_epp_session_affinity_test.go__pdConfigBase.yaml",
        "current/router__test_integration_epp_testdata_default-config.yaml__0.yaml",
        "current/router__test_integration_epp_wellknown_configs_test.go__1.yaml",
        "current/router__test_integration_epp_wellknown_configs_test.go__4.yaml",
        "current/router__test_integration_epp_wellknown_configs_test.go__5.yaml",
        "current/router__test_integration_epp_wellknown_configs_test.go__6.yaml",
        "current/router__test_integration_epp_wellknown_configs_test.go__7.yaml",
        "current/router__test_perf_config_router-configs_optimized-baseline.yaml__0.yaml",
        "current/router__test_perf_config_router-configs_precise-prefix.yaml__0.yaml",
        "current/router__test_perf_config_router-configs_random-passthrough-parser.yaml__0.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successComplexFlowControlConfigText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successDataLayerNoSourcesText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successDataLayerOptOutText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successDeprecatedTopLevelParserText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successDeprecatedTopLevelSaturationDetectorText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successExplicitPassthroughConfigText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successFlowControlConfigText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successFlowControlDisabledSaturationDetectorText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successMultipleParsersConfigText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successParserConfigText.yaml",
        "current-loader-fixtures/router__pkg_epp_config_loader_testdata_test.go__successParserWithNameConfigText.yaml",
        "older/gie__pkg_epp_framework_plugins_requestcontrol_requestattributereporter_README.md__0.yaml",
        "older/gie__pkg_epp_framework_plugins_requesthandling_parsers_README.md__0.yaml",
        "older/gie__site-src_guides_epp-configuration_config-text.md__3.yaml",
        "older/gie__site-src_guides_flow-control.md__0.yaml",
        "older/gie__site-src_guides_troubleshooting.md__1.yaml",
        "older/gie__site-src_implementations_model-servers.md__0.yaml",
        "older/gie__site-src_implementations_model-servers.md__1.yaml",
        "older/llmd__guides_agentic-serving_router.values.yaml__0.yaml",
        "older/llmd__guides_flow-control_router.values.yaml__0.yaml",
        "older/llmd__guides_optimized-baseline_router.values.yaml__0.yaml",
        "older/llmd__guides_pd-disaggregation_router.values.yaml__0.yaml",
        "older/llmd__guides_precise-prefix-cache-aware_scheduler.values.yaml__0.yaml",
        "older/llmd__guides_precise-prefix-cache-routing_router.values.yaml__0.yaml",
        "older/llmd__guides_predicted-latency_router.values.yaml__0.yaml",
        "older/llmd__guides_tiered-prefix-cache-cpu_router.values.yaml__0.yaml",
        "older/llmd__guides_turn-priority-fairness_router.values.yaml__0.yaml",
        "older/sched__chart_epplib_default-plugins_latencypredictor_rendered.yaml",
        "older/sched__chart_epplib_default-plugins_rendered.yaml",
        "older/sched__deploy_config_epp-precise-prefix-cache-config.yaml__0.yaml",
        "older/sched__deploy_config_probabilistic-admitter-epp-config.yaml__0.yaml",
        "older/sched__deploy_config_sim-e-p-d-epp-config.yaml__0.yaml",
        "older/sched__deploy_config_sim-e-pd-epp-config.yaml__0.yaml",
        "older/sched__deploy_config_sim-epp-kvcache-config.yaml__0.yaml",
        "older/sched__deploy_config_sim-epp-no-hit-lru.yaml__0.yaml",
        "older/sched__deploy_config_sim-epp-tokenizer-vllm-http-config.yaml__0.yaml",
        "older/sched__docs_architecture.md__1.yaml",
        "older/sched__docs_disaggregation.md__1.yaml",
        "older/sched__pkg_epp_framework_plugins_datalayer_source_models_README.md__0.yaml",
        "older/sched__pkg_epp_framework_plugins_requestcontrol_requestattributereporter_README.md__0.yaml",
        "older/sched__pkg_epp_framework_plugins_requesthandling_parsers_README.md__0.yaml",
        "older/sched__test_e2e_configs_test.go__decodeOnlyConfig.yaml",
        "older/sched__test_e2e_configs_test.go__epdConfig.yaml",
        "older/sched__test_e2e_configs_test.go__kvConfig.yaml",
        "older/sched__test_e2e_configs_test.go__kvExternalTokenizerConfig.yaml",
        "older/sched__test_integration_epp_grpc_test.go__testConfigWithVllmGRPCParser.yaml",
        "older/sched__test_integration_epp_hermetic_test.go__0.yaml",
        "older/sched__test_integration_epp_testdata_default-config.yaml__0.yaml",
        "older/sched__test_integration_epp_testdata_request-attribute-reporter-config.yaml__0.yaml",
        "older-loader-fixtures/gie__pkg_epp_config_loader_testdata_test.go__successComplexFlowControlConfigText.yaml",
        "older-loader-fixtures/gie__pkg_epp_config_loader_testdata_test.go__successDataLayerDisabledText.yaml",
        "older-loader-fixtures/gie__pkg_epp_config_loader_testdata_test.go__successDataLayerNoSourcesText.yaml",
        "older-loader-fixtures/gie__pkg_epp_config_loader_testdata_test.go__successParserConfigText.yaml",
        "older-loader-fixtures/gie__pkg_epp_config_loader_testdata_test.go__successParserWithNameConfigText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successComplexFlowControlConfigText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successDataLayerDisabledText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successDataLayerNoSourcesText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successDataLayerOptOutText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successParserConfigText.yaml",
        "older-loader-fixtures/sched__pkg_epp_config_loader_testdata_test.go__successParserWithNameConfigText.yaml",
        "v0.7/gie150__site-src_guides_troubleshooting.md__1.yaml",
        "v0.7/sched071__deploy_config_pd-epp-config.yaml__0.yaml",
        "v0.7/sched071__deploy_config_sim-epp-external-tokenizer-config.yaml__0.yaml",
        "v0.7/sched071__deploy_config_sim-epp-kvcache-config.yaml__0.yaml",
        "v0.7/sched071__deploy_config_sim-epp-no-hit-lru.yaml__0.yaml",
        "v0.7/sched071__deploy_config_sim-pd-epp-config.yaml__0.yaml",
        "v0.7/sched071__docs_architecture.md__1.yaml",
        "v0.7/sched071__docs_architecture.md__2.yaml",
        "v0.7/sched071__docs_disaggregation.md__0.yaml",
        "v0.7/sched071__docs_disaggregation.md__1.yaml",
        "v0.7/sched071__test_e2e_e2e_test.go__disaggDecodeOnlyConfig.yaml",
        "v0.7/sched071__test_e2e_e2e_test.go__kvConfig.yaml",
        "v0.7/sched071__test_e2e_e2e_test.go__kvExternalTokenizerConfig.yaml",
        "v0.7/sched071__test_e2e_e2e_test.go__pdConfig.yaml",
        "v0.7/sched071__test_e2e_e2e_test.go__pdDisaggConfig.yaml",
    }
)


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
    assert not GAPS & LATENCY


@pytest.mark.parametrize(("key", "path"), FILES, ids=[key for key, _ in FILES])
def test_corpus_file(key: str, path: Path) -> None:
    kind = _kind(path)
    if kind == "test-only":
        assert key not in GAPS and key not in LATENCY
        return
    if kind == "error":
        with pytest.raises(REFUSALS) as caught:
            load(path)
        assert str(caught.value)
        return
    if key in GAPS or key in LATENCY:
        with pytest.raises(REFUSALS):
            load(path)
        pytest.xfail("listed in GAPS/LATENCY: not loadable yet")
    load(path)
