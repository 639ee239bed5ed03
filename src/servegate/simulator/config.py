"""Configuration of one simulated model server.

Every knob is a field of a frozen pydantic model that rejects unknown keys, so a
typo in a YAML file is a startup error that names the key. Defaults describe a
mid-sized model on one accelerator; tests shrink the cache and raise `speed`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Persona = Literal["vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"]
SimRole = Literal["prefill", "decode", "prefill-decode"]
FaultKind = Literal["disconnect", "stream_error", "stream_cut"]

PERSONAS: tuple[str, ...] = ("vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm")
_ROLE_ALIASES = {"both": "prefill-decode", "": "prefill-decode"}


class SimConfigError(ValueError):
    """A simulator configuration that cannot be used; the message says how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostModel(_Strict):
    """Step time = step_overhead_s + prefill_token_s x uncached prompt tokens computed
    in the step + decode_seq_s x decoding sequences in the step, divided by `speed`."""

    step_overhead_s: Annotated[float, Field(ge=0)] = 0.004
    prefill_token_s: Annotated[float, Field(ge=0)] = 0.00004
    decode_seq_s: Annotated[float, Field(ge=0)] = 0.0002


class LoraSettings(_Strict):
    """LoRA slots as vLLM's `--enable-lora --max-loras N --lora-modules a=path`."""

    enable: bool = False
    max_loras: Annotated[int, Field(ge=1)] = 1
    adapters: list[str] = Field(default_factory=list)
    """Preloaded adapters, each `name` or `name=path`."""
    load_latency_s: Annotated[float, Field(ge=0)] = 0.05
    """Time `POST /v1/load_lora_adapter` takes."""
    activation_latency_s: Annotated[float, Field(ge=0)] = 0.01
    """Added to a step that brings an adapter into a free slot."""

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.adapters)

    def adapter_paths(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.adapters:
            name, sep, path = item.partition("=")
            name = name.strip()
            if not name:
                raise SimConfigError(
                    f"lora adapter {item!r} has no name; write `name` or `name=path`"
                )
            out[name] = path.strip() if sep else f"/adapters/{name}"
        return out


class KVEventsSettings(_Strict):
    """vLLM's `--kv-events-config` (ZMQ publisher)."""

    enable: bool = False
    endpoint: str | None = None
    """`tcp://*:5557` or `ipc:///tmp/kv.sock`; port 0 picks a free port."""
    replay_endpoint: str | None = None
    topic: str | None = None
    """Default `kv@<host:port>@<model>`."""
    encoding: Literal["map", "array"] = "map"
    """`map`: recent vLLM (events tagged with "type"); `array`: older vLLM and SGLang."""
    bind: bool | None = None
    """None follows vLLM: bind for `*`, `::`, `ipc://`, `inproc://`, otherwise connect."""
    buffer_steps: Annotated[int, Field(ge=1)] = 10_000

    @property
    def enabled(self) -> bool:
        return self.enable or self.endpoint is not None


class FaultSettings(_Strict):
    """Injected faults. `error_kinds` entries are HTTP statuses or `disconnect`,
    `stream_error` (a vLLM error event inside a 200 stream), `stream_cut`."""

    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.0
    error_kinds: list[int | FaultKind] = Field(default_factory=lambda: [500])  # type: ignore[arg-type]
    startup_delay_s: Annotated[float, Field(ge=0)] = 0.0
    startup_listen: bool = True
    """During the startup delay: True answers 503, False does not listen at all."""
    crash_exits_process: bool = False
    """`POST /admin/fault {"mode": "crash"}` ends the process (the CLI sets this)."""

    @model_validator(mode="after")
    def _check_kinds(self) -> FaultSettings:
        for kind in self.error_kinds:
            if isinstance(kind, int) and not 400 <= kind <= 599:
                raise ValueError(f"error kind {kind} is not an HTTP error status (400-599)")
        if self.error_rate > 0 and not self.error_kinds:
            raise ValueError("error_rate > 0 needs at least one entry in error_kinds")
        return self


class OutputSettings(_Strict):
    mode: Literal["random", "echo"] = "random"
    """`random`: seeded words; `echo`: the prompt's own tokens, cycled."""
    eos_probability: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Chance per generated token that the model stops (finish_reason `stop`)."""
    default_max_tokens: Annotated[int, Field(ge=1)] | None = None
    """When a request sets no limit; None = what is left of max_model_len, as vLLM."""


class TokenizerSettings(_Strict):
    path: str | None = None
    """A HuggingFace tokenizer folder (needs the `tokenizers` package); None = built-in."""


class SimConfig(_Strict):
    model: str = "sim-model"
    model_path: str | None = None
    """Reported as `root` in `/v1/models`; defaults to the model name."""
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    """Triton persona only: the metrics port (default 8002; 0 picks a free one)."""
    persona: Persona = "vllm"
    role: SimRole = "prefill-decode"
    engine_id: str | None = None
    """NIXL `remote_engine_id` a prefill server reports; default derived from host:port."""

    max_model_len: Annotated[int, Field(ge=2)] = 4096
    max_num_seqs: Annotated[int, Field(ge=1)] = 256
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 2048
    enable_chunked_prefill: bool = True
    num_blocks: Annotated[int, Field(ge=2)] = 2048
    block_size: Annotated[int, Field(ge=1)] = 16
    enable_prefix_caching: bool = True

    costs: CostModel = Field(default_factory=CostModel)
    speed: Annotated[float, Field(gt=0)] = 1.0
    seed: int = 0

    lora: LoraSettings = Field(default_factory=LoraSettings)
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings)
    faults: FaultSettings = Field(default_factory=FaultSettings)
    output: OutputSettings = Field(default_factory=OutputSettings)
    tokenizer: TokenizerSettings = Field(default_factory=TokenizerSettings)

    enable_prompt_tokens_details: bool = True
    """Report `usage.prompt_tokens_details.cached_tokens` (vLLM needs a flag for it)."""
    admin: bool = True
    """Serve `/admin/fault`."""

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("role"), str):
            role = data["role"]
            data = {**data, "role": _ROLE_ALIASES.get(role, role)}
        return data

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        usable = (self.num_blocks - 1) * self.block_size
        if usable < self.max_model_len:
            raise ValueError(
                f"(num_blocks - 1) x block_size = {usable} tokens (block 0 is reserved, as in "
                f"vLLM) cannot hold one sequence of max_model_len = {self.max_model_len}; raise "
                "num_blocks or lower max_model_len"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
        self.lora.adapter_paths()
        return self

    @property
    def served_root(self) -> str:
        return self.model_path or self.model

    def with_overrides(self, **changes: Any) -> SimConfig:
        """A copy with top-level fields replaced, validated again."""
        data = self.model_dump()
        data.update(changes)
        return parse_sim_config(data)


def parse_sim_config(data: dict[str, Any]) -> SimConfig:
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise SimConfigError(_describe(exc)) from exc


def load_sim_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> SimConfig:
    """Read a YAML file (a mapping of SimConfig fields), then apply `overrides` on top;
    nested mappings in `overrides` merge into the file's."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SimConfigError(f"cannot read simulator config {path}: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SimConfigError(f"{path}: expected a mapping of simulator settings at the top")
        data = loaded
    if overrides:
        data = _merge(data, overrides)
    return parse_sim_config(data)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown setting (check the spelling; see docs/simulator.md)")
        else:
            parts.append(f"{where}: {err['msg']}")
    return "invalid simulator config: " + "; ".join(parts)
