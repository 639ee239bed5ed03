"""servegate's own configuration: one YAML file, `SERVEGATE_…` env overrides, CLI flags.

Errors name the field, the file position and what to do, because a gateway that
starts with a silently ignored setting is worse than one that refuses to start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from servegate.datalayer.health import HealthSettings
from servegate.datalayer.kvevents.settings import KVEventsSettings
from servegate.datalayer.outlier import OutlierDetectionSettings
from servegate.datalayer.scraper import ScrapeSettings
from servegate.pool.discovery.settings import DiscoverySettings, StaticDiscoverySettings
from servegate.pool.endpoint import Endpoint, Role
from servegate.rewrites import ModelRewrite
from servegate.scaleout.settings import ScaleOutSettings
from servegate.scheduling.flowcontrol.settings import FlowControlSettings
from servegate.scheduling.latency.settings import LatencySettings
from servegate.tokenization.settings import TokenizerSettings

ENV_PREFIX = "SERVEGATE_"


class ConfigError(Exception):
    """A configuration problem, with a message meant for the person fixing it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PositiveFloat = Annotated[float, Field(gt=0)]


class GatewaySettings(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on /v1/*; empty = no authentication."""
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    connect_timeout_s: PositiveFloat = 5.0
    first_byte_timeout_s: PositiveFloat = 300.0
    """Until the upstream's response headers; vLLM sends them at once when streaming."""
    total_timeout_s: PositiveFloat = 1800.0
    max_retries: int = Field(2, ge=0, le=10)
    """Extra attempts on other endpoints, only before the first byte reaches the client."""
    debug_headers: bool = False
    """Adds `x-servegate-scores` with every endpoint's per-scorer scores."""
    access_log: bool = True
    seed: int | None = None
    """Seeds the scheduler's tie-breaking; None = random."""
    admin_keys: tuple[str, ...] = ()
    """Bearer keys for /admin/*; empty = the admin routes answer 403 to everyone."""
    max_header_bytes: int = Field(8190, ge=1024, le=1024 * 1024)
    """Longest request header field (aiohttp `max_field_size`); longer → 400."""
    max_line_bytes: int = Field(8190, ge=1024, le=1024 * 1024)
    """Longest request line (aiohttp `max_line_size`); longer → 400."""
    max_headers: int = Field(128, ge=8, le=4096)
    """Most request header fields (aiohttp `max_headers`)."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM: stop accepting, then let in-flight requests finish for up to this long."""
    probe_port: int | None = Field(None, ge=0, le=65535)
    """Serve /health and /ready also on this port, from a thread of their own (None = off)."""

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _no_blank_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:
            if not key.strip():
                raise ValueError(
                    "an empty or blank key would let anyone in (a request with no key "
                    "matches it); remove it, or leave the list empty to turn authentication off"
                )
            if key != key.strip():
                raise ValueError("a key must not start or end with whitespace; strip it")
        return keys

    idle_timeout_s: PositiveFloat = 60.0
    """Close a client connection that sends nothing for this long (keep-alive idle, and a
    connection that never sends a request)."""
    header_timeout_s: PositiveFloat = 10.0
    """A request head must arrive completely within this long of its first byte."""
    body_timeout_s: PositiveFloat = 60.0
    """A request body must arrive completely within this long (else 408)."""
    max_connections: int | None = Field(None, ge=1)
    """Open client connections at most; None = three quarters of the file-descriptor limit.
    A newcomer over the cap displaces the longest-idle connection, else gets 503."""
    max_buffered_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """A non-streamed upstream answer up to this size is read whole (for its usage); a
    longer one is relayed as it comes. Answers that must be translated whole (Triton) and
    the P/D prefill leg's answer get 502 (fallback) past it."""
    max_connections_per_client: int | None = Field(None, ge=1)
    """Open connections per client address; None = no limit besides `max_connections`."""
    upstream_client: Literal["lean", "aiohttp"] = "lean"
    """The request path's HTTP client to replicas: `lean` (pooled HTTP/1.1 on asyncio
    protocols with httptools' parser, `gateway/lean_transport.py`) or aiohttp's. Read when
    the gateway starts; a reload keeps the running one."""
    http_server: Literal["lean", "aiohttp"] = "lean"
    """The server of the inference routes: `lean` (an httptools protocol that answers POSTs
    to the inference routes itself and hands every other request's connection to aiohttp,
    `gateway/lean_server.py`) or aiohttp's. Read when the gateway starts."""


class TenantSettings(_Strict):
    """A tenant: the API keys that are its, and what its requests may claim (docs/configuration.md)."""

    name: str = Field(min_length=1, max_length=128)
    keys: tuple[SecretStr, ...] = ()
    """Inline keys (prefer `key_files` or `key_env`: a config file is often world-readable)."""
    key_files: tuple[str, ...] = ()
    """Files holding keys, one per line (`#` comments and blank lines skipped); relative to
    the config file's folder. A Kubernetes Secret mounted as files fits here."""
    key_env: tuple[str, ...] = ()
    """Environment variables each holding one key."""
    fairness_id: str | None = Field(None, min_length=1, max_length=256)
    """The flow its requests are queued in, whatever header they send; None = `name`."""
    max_priority: int | None = None
    """The highest priority its requests may claim (through the objective they name); a
    higher one is lowered to this. None = any."""
    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    """Prompt plus `max_tokens` (estimated at arrival, settled with the reported usage)."""

    @model_validator(mode="after")
    def _has_keys(self) -> TenantSettings:
        if not (self.keys or self.key_files or self.key_env):
            raise ValueError(f"tenant {self.name!r} has no keys: set key_files, key_env or keys")
        for key in self.keys:
            secret = key.get_secret_value()
            if not secret.strip() or secret != secret.strip():
                raise ValueError(
                    f"tenant {self.name!r}: a blank or padded key would let anyone in; remove it"
                )
        return self


class RetrySettings(_Strict):
    budget_percent: float = Field(20.0, ge=0, le=100)
    """Retries may add at most this share of the requests seen over the window."""
    min_retries_per_s: float = Field(10.0, ge=0)
    """Retries always allowed, however few requests came."""
    window_s: PositiveFloat = 10.0
    backoff_base_s: float = Field(0.01, ge=0)
    backoff_max_s: float = Field(0.25, ge=0)


class EndpointConfig(_Strict):
    url: str
    engine: str | None = None
    """Engine type; default from the `llm-d.ai/engine-type` label, else `vllm`."""
    role: Role | None = None
    model: str | None = None
    """The base model served; None = learn it from the replica's /v1/models."""
    labels: dict[str, str] = Field(default_factory=dict)
    metrics_url: str | None = None
    kv_events: str | None = None
    """Where the replica publishes KV events (`tcp://host:5557`, `ipc:///path`)."""
    kv_events_replay: str | None = None
    """Its replay ROUTER socket, for recovering batches lost to a sequence gap."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"endpoint url must look like http://host:port, got {value!r}")
        return value.rstrip("/")

    def to_endpoint(self, pool: str) -> Endpoint:
        parts = urlsplit(self.url)
        address = f"{parts.hostname}:{parts.port}"
        engine = self.engine or self.labels.get("llm-d.ai/engine-type", "vllm")
        role = self.role
        if role is None:
            label = self.labels.get("llm-d.ai/role")
            role = Role(label) if label in {r.value for r in Role} else Role.BOTH
        model = self.model or self.labels.get("llm-d.ai/model")
        return Endpoint(
            address=address,
            url=self.url,
            engine=engine,
            role=role,
            model=model,
            labels=dict(self.labels),
            metrics_url=self.metrics_url,
            kv_events=self.kv_events,
            kv_events_replay=self.kv_events_replay,
            pool=pool,
        )


class ModelDeclaration(_Strict):
    id: str
    parent: str | None = None
    tokenizer: TokenizerSettings | None = None
    """Overrides the pool's `tokenizer` for this model (and its adapters)."""
    chat_template: str | None = None
    """For text-only engines (Triton): inline Jinja, or a file path relative to the config;
    None = the tokenizer folder's template, else ChatML (docs/backends.md)."""


class PoolSettings(_Strict, ScrapeSettings):
    """One pool; its scrape settings (`scrape_interval_s`, `scrape_timeout_s`) are
    `ScrapeSettings`' fields, written flat on the pool."""

    name: str = "default"
    endpoints: tuple[EndpointConfig, ...] = ()
    models: tuple[ModelDeclaration, ...] = ()
    """Models (and LoRA adapters with their `parent`) known before any replica answers."""
    metrics_staleness_s: PositiveFloat = 2.0
    health: HealthSettings = HealthSettings()
    engines: tuple[dict[str, Any], ...] = ()
    """User-defined engines, llm-d `engineConfigs` shape."""
    tokenizer: TokenizerSettings | None = None
    """Tokenisation for routing, for every model without its own; None = `source: auto`
    (`{source: chars}` turns it off)."""
    kv_events: KVEventsSettings = KVEventsSettings()
    discovery: DiscoverySettings = StaticDiscoverySettings()
    """`static`: `endpoints` only; `kubernetes`: also follow pods (see pool/discovery/settings.py)."""
    latency: LatencySettings = LatencySettings()
    """How the pool's latency predictor learns (scheduling/latency/settings.py)."""


class PoolEntry(PoolSettings):
    """One of `pools:`: a pool with, optionally, its own picker profile and flow control."""

    picker: dict[str, Any] | str | None = None
    """An EndpointPickerConfig (inline or a path); None = the top-level `picker`."""
    flow_control: FlowControlSettings | None = None
    """None = the top-level `flow_control`."""

    def base(self) -> PoolSettings:
        """The pool's own settings, without picker and flow control."""
        return PoolSettings.model_validate(
            self.model_dump(exclude={"picker", "flow_control"}, round_trip=True)
        )


class ReloadSettings(_Strict):
    """Re-reading the config file at run time (SIGHUP, `POST /admin/reload`, or watching)."""

    watch: bool = False
    """Poll the file's modification time and reload when it changes."""
    interval_s: PositiveFloat = 2.0
    warmup_s: float = Field(5.0, ge=0)
    """The longest a reload waits for a newly added pool's first ready endpoint."""


class ExtProcSettings(_Strict):
    """`servegate extproc`: the Envoy ext_proc endpoint picker (Gateway API Inference Extension)."""

    host: str = "0.0.0.0"
    port: int = Field(9002, ge=0, le=65535)
    """The `envoy.service.ext_proc.v3.ExternalProcessor` gRPC service."""
    health_port: int = Field(9003, ge=0, le=65535)
    """gRPC health: services `liveness`, `readiness` and the ExternalProcessor's name."""
    metrics_port: int = Field(9090, ge=0, le=65535)
    """Prometheus `/metrics` (plus `/health` and `/ready`) over HTTP."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM: report NOT_SERVING, then let open streams finish for up to this long."""


class DisaggregationSettings(_Strict):
    """How a prefill/decode decision is carried out (docs/disaggregation.md)."""

    mode: Literal["auto", "sidecar", "gateway"] = "auto"
    """`sidecar`: send to the decode replica with `x-prefiller-host-port` (llm-d's routing
    sidecar runs the prefill leg); `gateway`: the gateway runs both legs (vLLM's NIXL
    connector), only when configured; `auto`: sidecar, as llm-d's `disagg-profile-handler`
    does whether or not the older `disagg-headers-handler` is declared."""
    prefill_timeout_s: PositiveFloat | None = None
    """Gateway mode: the longest wait for the prefill leg's answer before falling back to
    decode-only; None = `gateway.first_byte_timeout_s`."""


class ServegateConfig(_Strict):
    gateway: GatewaySettings = GatewaySettings()
    pool: PoolSettings = PoolSettings()
    flow_control: FlowControlSettings = FlowControlSettings()
    retries: RetrySettings = RetrySettings()
    outlier_detection: OutlierDetectionSettings = OutlierDetectionSettings()
    extproc: ExtProcSettings = ExtProcSettings()
    disaggregation: DisaggregationSettings = DisaggregationSettings()
    picker: dict[str, Any] | str | None = None
    """An EndpointPickerConfig document, inline or a path to one; None = the default profile."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    pools: tuple[PoolEntry, ...] = ()
    """Several pools (the first is the default); empty = the one `pool`."""
    model_rewrites: tuple[ModelRewrite, ...] = ()
    """Public model names mapped to weighted targets (InferenceModelRewrite)."""
    reload: ReloadSettings = ReloadSettings()
    tenants: tuple[TenantSettings, ...] = ()
    """API keys mapped to tenants (fairness id, priority ceiling, rate limits); their keys
    are accepted alongside `gateway.api_keys`."""
    scaleout: ScaleOutSettings = ScaleOutSettings()
    """Several worker processes and replicas sharing routing state (docs/scaleout.md)."""

    @model_validator(mode="after")
    def _tenant_names(self) -> ServegateConfig:
        names = [t.name for t in self.tenants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tenants: names must be unique; {twice} used more than once")
        return self

    @model_validator(mode="after")
    def _pools(self) -> ServegateConfig:
        if not self.pools:
            return self
        names = [p.name for p in self.pools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pools: names must be unique; {twice} used more than once")
        first = self.pools[0].base()
        if "pool" in self.model_fields_set and self.pool != first:
            raise ValueError(
                "`pool` and `pools` are both set; move `pool` into `pools` (the first is the default)"
            )
        object.__setattr__(self, "pool", first)
        return self

    @model_validator(mode="after")
    def _rewrites(self) -> ServegateConfig:
        pools = {p.name for p in self.pool_entries()}
        seen: dict[str, int] = {}
        wildcard = 0
        for index, rewrite in enumerate(self.model_rewrites):
            if rewrite.pool_ref is not None and rewrite.pool_ref not in pools:
                raise ValueError(
                    f"model_rewrites[{index}]: poolRef {rewrite.pool_ref!r} names no pool;"
                    f" pools are {sorted(pools)}"
                )
            for rule in rewrite.rules:
                wildcard += not rule.matches
                for match in rule.matches:
                    if match.model in seen:
                        raise ValueError(
                            f"model_rewrites[{index}]: model {match.model!r} is already matched"
                            f" by model_rewrites[{seen[match.model]}]"
                        )
                    seen[match.model] = index
        if wildcard > 1:
            raise ValueError("model_rewrites: at most one rule may have empty `matches`")
        return self

    def pool_entries(self) -> tuple[PoolEntry, ...]:
        """Every pool with its picker and flow control resolved; the first is the default."""
        entries = self.pools or (PoolEntry.model_validate(self.pool.model_dump(round_trip=True)),)
        return tuple(
            e.model_copy(
                update={
                    "picker": e.picker if e.picker is not None else self.picker,
                    "flow_control": e.flow_control or self.flow_control,
                }
            )
            for e in entries
        )

    def picker_document(self, base_dir: Path | None = None) -> dict[str, Any] | str | None:
        """The picker config as a mapping or YAML text, reading a path if one was given."""
        return read_picker(self.picker, base_dir)


def read_picker(
    picker: dict[str, Any] | str | None, base_dir: Path | None = None
) -> dict[str, Any] | str | None:
    """A picker setting as a mapping or YAML text, reading a path if one was given."""
    if isinstance(picker, str):
        path = Path(picker)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        try:
            return path.read_text()
        except OSError as exc:
            raise ConfigError(f"picker: cannot read {path}: {exc.strerror}") from exc
    return picker


# -- loading ---------------------------------------------------------------------

Positions = dict[tuple[str | int, ...], str]


def _mark(node: yaml.Node, source: str) -> str:
    return f"{source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def _positions(node: yaml.Node, source: str, path: tuple[str | int, ...] = ()) -> Positions:
    """Where each field is written; a mapping entry points at its key."""
    out: Positions = {path: _mark(node, source)}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = (*path, str(key.value))
            out.update(_positions(value, source, child))
            out[child] = _mark(key, source)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            out.update(_positions(item, source, (*path, index)))
    return out


def _set_path(doc: dict[str, Any], path: list[str], value: Any) -> None:
    cursor = doc
    for key in path[:-1]:
        nxt = cursor.get(key)
        if not isinstance(nxt, dict):
            nxt = {}
            cursor[key] = nxt
        cursor = nxt
    cursor[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """`SERVEGATE_GATEWAY__PORT=9000` → {"gateway": {"port": 9000}}; values are YAML scalars."""
    doc: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw else raw
        except yaml.YAMLError:
            value = raw
        _set_path(doc, path, value)
    return doc


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_errors(exc: ValidationError, positions: Positions) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ""
        for cut in range(len(loc), -1, -1):
            if loc[:cut] in positions:
                where = f" ({positions[loc[:cut]]})"
                break
        dotted = ".".join(str(p) for p in loc) or "<root>"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field; remove it or check its spelling"
        lines.append(f"  {dotted}{where}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def parse_config(
    text: str,
    source: str = "<config>",
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServegateConfig:
    try:
        node = yaml.compose(text) if text.strip() else None
        raw = yaml.safe_load(text) if node is not None else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    positions = _positions(node, source) if node is not None else {}
    doc = _merge(raw, env_overrides(os.environ if environ is None else environ))
    if overrides:
        doc = _merge(doc, overrides)
    try:
        return ServegateConfig.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, positions)) from exc


def load_config(
    path: str | Path | None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServegateConfig:
    if path is None:
        return parse_config("", "<defaults>", environ, overrides)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
    return parse_config(text, str(p), environ, overrides)
