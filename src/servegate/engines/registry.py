"""The engines servegate knows: the built-in four plus any a user describes in YAML.

A custom engine is described with the fields of llm-d's `core-metrics-extractor`
`engineConfigs` entries, so an llm-d engine block loads unchanged:

```yaml
engineConfigs:
- name: my-engine
  queuedRequestsSpec: "my_queue_size{status=waiting}"
  runningRequestsSpec: my_running
  kvUsageSpec: my_cache_utilization
  cacheBlockSizeSpec: my_tokens_per_block
  metricsPath: /metrics          # servegate addition, like the fields below
```

A spec string is a PromQL instant-vector selector with equality matchers only:
`name` or `name{label=value,label2="value"}`. servegate adds `metricsPath`,
`metricsPort`, `healthPath`, `healthPort`, `openaiModels`,
`prefixCacheQueriesSpec` and `prefixCacheHitsSpec`. An entry named like a
built-in engine replaces it, as in llm-d.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.engines import sglang, triton, trtllm, vllm
from servegate.engines.spec import Aggregation, EngineSpec, MetricSpec, Signal
from servegate.pool.endpoint import ENGINE_LABEL, Endpoint

DEFAULT_ENGINE = "vllm"


class EngineConfigError(ValueError):
    """A custom engine description that cannot be used; the message says how to fix it."""


class UnknownEngineError(LookupError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(
            f"unknown engine {name!r}; known engines: {', '.join(self.known)} "
            f"(set the pod label {ENGINE_LABEL} to one of them, or describe the engine "
            "under engineConfigs)"
        )

    def __str__(self) -> str:
        return str(self.args[0])


def builtin_engines() -> dict[str, EngineSpec]:
    return {spec.name: spec for spec in (vllm.SPEC, sglang.SPEC, trtllm.SPEC, triton.SPEC)}


def engine_for_labels(labels: Mapping[str, str], default: str = DEFAULT_ENGINE) -> str:
    """The engine named by the `llm-d.ai/engine-type` pod label (vLLM without one)."""
    return labels.get(ENGINE_LABEL) or default


class EngineConfig(BaseModel):
    """One `engineConfigs` entry (llm-d's field names; empty string = not published)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    queued_requests_spec: str = Field("", alias="queuedRequestsSpec")
    running_requests_spec: str = Field("", alias="runningRequestsSpec")
    kv_usage_spec: str = Field("", alias="kvUsageSpec")
    lora_spec: str = Field("", alias="loraSpec")
    cache_info_spec: str = Field("", alias="cacheInfoSpec")
    cache_block_size_label_name: str = Field("", alias="cacheBlockSizeLabelName")
    cache_num_blocks_label_name: str = Field("", alias="cacheNumBlocksLabelName")
    cache_block_size_spec: str = Field("", alias="cacheBlockSizeSpec")
    cache_num_blocks_spec: str = Field("", alias="cacheNumBlocksSpec")
    prefix_cache_queries_spec: str = Field("", alias="prefixCacheQueriesSpec")
    prefix_cache_hits_spec: str = Field("", alias="prefixCacheHitsSpec")
    metrics_path: str = Field("/metrics", alias="metricsPath", pattern=r"^/")
    metrics_port: int | None = Field(None, alias="metricsPort", ge=1, le=65535)
    health_path: str = Field("/health", alias="healthPath", pattern=r"^/")
    health_port: int | None = Field(None, alias="healthPort", ge=1, le=65535)
    openai_models: bool = Field(True, alias="openaiModels")

    def to_spec(self) -> EngineSpec:
        block_label = self.cache_block_size_label_name or "block_size"
        blocks_label = self.cache_num_blocks_label_name or "num_gpu_blocks"
        block_size: list[MetricSpec] = []
        num_blocks: list[MetricSpec] = []
        if self.cache_info_spec:
            block_size.append(
                _source(self.cache_info_spec, "cacheInfoSpec", Aggregation.MAX, block_label)
            )
            num_blocks.append(
                _source(self.cache_info_spec, "cacheInfoSpec", Aggregation.SUM, blocks_label)
            )
        block_size.extend(
            _signal(self.cache_block_size_spec, "cacheBlockSizeSpec", Aggregation.MAX)
        )
        num_blocks.extend(
            _signal(self.cache_num_blocks_spec, "cacheNumBlocksSpec", Aggregation.SUM)
        )
        return EngineSpec(
            name=self.name,
            metrics_path=self.metrics_path,
            metrics_port=self.metrics_port,
            health_path=self.health_path,
            health_port=self.health_port,
            openai_models=self.openai_models,
            waiting=_signal(self.queued_requests_spec, "queuedRequestsSpec", Aggregation.SUM),
            running=_signal(self.running_requests_spec, "runningRequestsSpec", Aggregation.SUM),
            kv_usage=_signal(self.kv_usage_spec, "kvUsageSpec", Aggregation.MEAN),
            block_size=tuple(block_size),
            num_blocks=tuple(num_blocks),
            lora=_signal(self.lora_spec, "loraSpec", Aggregation.LATEST_BY_VALUE),
            prefix_cache_queries=_signal(
                self.prefix_cache_queries_spec, "prefixCacheQueriesSpec", Aggregation.SUM
            ),
            prefix_cache_hits=_signal(
                self.prefix_cache_hits_spec, "prefixCacheHitsSpec", Aggregation.SUM
            ),
        )


_SELECTOR = re.compile(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*", re.DOTALL)
_MATCHER = re.compile(
    r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*("(?:[^"\\]|\\.)*"|[^",}\s]+)\s*(,|$)',
    re.DOTALL,
)


def parse_selector(text: str, field: str = "spec") -> tuple[str, tuple[tuple[str, str], ...]]:
    """`name{a=b,c="d"}` → (name, (("a", "b"), ("c", "d")))."""
    match = _SELECTOR.fullmatch(text)
    if match is None:
        raise EngineConfigError(
            f"{field}: {text!r} is not a metric selector; write name or name{{label=value}}"
        )
    name, body = match.group(1), match.group(2)
    labels: list[tuple[str, str]] = []
    pos = 0
    body = (body or "").strip()
    while pos < len(body):
        matcher = _MATCHER.match(body, pos)
        if matcher is None:
            raise EngineConfigError(
                f"{field}: cannot read the labels of {text!r}; "
                "write label=value, separated by commas"
            )
        label, op, raw, comma = matcher.groups()
        if op != "=":
            raise EngineConfigError(
                f"{field}: {text!r} uses the matcher {op!r}; "
                "only equality (label=value) is supported"
            )
        value = raw[1:-1] if raw.startswith('"') else raw
        labels.append((label, re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)))
        pos = matcher.end()
        if not comma and pos < len(body):
            raise EngineConfigError(f"{field}: labels of {text!r} must be separated by commas")
    return name, tuple(labels)


def _source(
    text: str, field: str, aggregation: Aggregation, label: str | None = None
) -> MetricSpec:
    name, labels = parse_selector(text, field)
    return MetricSpec(name, labels=labels, label=label, aggregation=aggregation)


def _signal(text: str, field: str, aggregation: Aggregation) -> Signal:
    if not text.strip():
        return ()
    return (_source(text, field, aggregation),)


def _load(document: object) -> object:
    if isinstance(document, str):
        try:
            return yaml.safe_load(document)
        except yaml.YAMLError as exc:
            raise EngineConfigError(f"engine configuration is not valid YAML: {exc}") from exc
    return document


def _describe(exc: ValidationError, name: object) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "entry"
        if error["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key (check the spelling; keys are camelCase)")
        else:
            problems.append(f"{where}: {error['msg']}")
    label = f"engine config {name!r}" if isinstance(name, str) else "engine config"
    return f"{label}: " + "; ".join(problems)


def decode_engine_config(document: Mapping[str, Any] | str) -> EngineSpec:
    """One `engineConfigs` entry (mapping or YAML text) → `EngineSpec`."""
    data = _load(document)
    if not isinstance(data, Mapping):
        raise EngineConfigError(
            f"an engine config must be a mapping with at least 'name', got {type(data).__name__}"
        )
    try:
        config = EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise EngineConfigError(_describe(exc, data.get("name"))) from exc
    return config.to_spec()


class EngineRegistry:
    """Engine name → `EngineSpec`; built at startup, read by the data layer."""

    def __init__(self, engines: Iterable[EngineSpec] | None = None) -> None:
        specs = builtin_engines().values() if engines is None else engines
        self._engines: dict[str, EngineSpec] = {spec.name: spec for spec in specs}

    def get(self, name: str) -> EngineSpec:
        spec = self._engines.get(name)
        if spec is None:
            raise UnknownEngineError(name, self._engines)
        return spec

    def for_endpoint(self, endpoint: Endpoint) -> EngineSpec:
        return self.get(endpoint.engine)

    def for_labels(self, labels: Mapping[str, str], default: str = DEFAULT_ENGINE) -> EngineSpec:
        return self.get(engine_for_labels(labels, default))

    def names(self) -> list[str]:
        return sorted(self._engines)

    def __contains__(self, name: object) -> bool:
        return name in self._engines

    def add(self, spec: EngineSpec) -> None:
        self._engines[spec.name] = spec

    def add_custom(self, document: Mapping[str, Any] | str) -> EngineSpec:
        """Add (or replace) one engine from an `engineConfigs` entry."""
        spec = decode_engine_config(document)
        self.add(spec)
        return spec

    def add_engine_configs(
        self, document: Mapping[str, Any] | Sequence[Mapping[str, Any]] | str
    ) -> list[EngineSpec]:
        """Add every entry of `{engineConfigs: [...]}` or of a bare list; all or nothing."""
        data = _load(document)
        if isinstance(data, Mapping):
            unknown = set(data) - {"engineConfigs"}
            if unknown:
                raise EngineConfigError(
                    f"unknown key(s) {', '.join(sorted(map(str, unknown)))} beside engineConfigs"
                )
            data = data.get("engineConfigs") or []
        if not isinstance(data, list):
            raise EngineConfigError("engineConfigs must be a list of engine configs")
        specs = [decode_engine_config(entry) for entry in data]
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise EngineConfigError(f"engineConfigs names must be unique: {', '.join(duplicates)}")
        for spec in specs:
            self.add(spec)
        return specs
