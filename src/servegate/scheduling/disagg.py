"""Prefill/decode disaggregation and data-parallel routing: profile handlers and deciders.

Disaggregation runs two scheduling profiles, each with its own filters and
scorers: `decode` first, then, if a *decider* says the prompt's uncached part is
worth a separate prefill, `prefill`. The decision carries the decode endpoint
(with its fallbacks) and the prefill endpoint; the data plane then either names
the prefill endpoint to the decode replica's sidecar (`x-prefiller-host-port`)
or runs the two legs itself (`gateway/disagg.py`).

Type strings and parameters are llm-d's, in every spelling llm-d has shipped:

- `disagg-profile-handler`: `profiles.{decode,prefill}` and `deciders.prefill`
  (current), or the flat `decodeProfile`, `prefillProfile`,
  `prefillDeciderPluginName` / `deciderPluginName` (deprecated, not mixable with
  the nested form); `primaryPort` from the versions that had it;
- `pd-profile-handler` (the older name): `decodeProfile`, `prefillProfile`,
  `deciderPluginName`, `primaryPort`, or the built-in `threshold` rule
  (uncached prompt characters) of the versions before deciders existed;
- `prefix-based-pd-decider` (`nonCachedTokens`) and `always-disagg-pd-decider`;
- `data-parallel-profile-handler` (`primaryPort`);
- `disagg-headers-handler` / `prefill-header-handler`: in llm-d (deprecated there)
  they wrote the sidecar header; here the data plane writes it. The sidecar
  protocol is the default (`disaggregation.mode: auto`) with or without them.

`primaryPort` is llm-d's data parallelism behind a sidecar: every rank is its
own endpoint (`ip:rank_port`); the request goes to `ip:primaryPort`, the
sidecar, with the chosen rank in `x-data-parallel-host-port`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol, Self, runtime_checkable

from pydantic import Field, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import (
    ParameterlessPlugin,
    Parameters,
    PluginContext,
    decode_parameters,
)
from servegate.scheduling.framework import (
    CycleState,
    Decision,
    Plugin,
    ProfileResult,
    SchedulerProfile,
    Scorer,
)
from servegate.scheduling.prefix.lookup import PREFIX_SCORER_TYPES, prefix_scores
from servegate.scheduling.request import LLMRequest, RequestKind

PREFILLER_HEADER = "x-prefiller-host-port"
ENCODERS_HEADER = "x-encoder-hosts-ports"
DATA_PARALLEL_HEADER = "x-data-parallel-host-port"
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's header choosing the data-parallel rank behind a single API server."""


def least_loaded_rank(state: EndpointState) -> int | None:
    """The rank with the fewest waiting + running requests (lowest rank on ties); None
    when the endpoint's metrics show a single rank."""
    load = state.metrics.rank_load
    if not load:
        return None
    return min(load, key=lambda rank: (load[rank], rank))


DECODE_ONLY = "decode-only"
PREFILL_DECODE = "prefill-decode"
DEFAULT_DECODE_PROFILE = "decode"
DEFAULT_PREFILL_PROFILE = "prefill"
DEFAULT_ENCODE_PROFILE = "encode"
DEFAULT_DP_PRIMARY_PORT = 8000


@runtime_checkable
class PDDecider(Plugin, Protocol):
    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> bool:
        """True when `request` should be prefilled elsewhere before `decode` decodes it."""
        ...


# -- deciders --------------------------------------------------------------------------


def _prefix_scorers(
    owner: str, plugins: Mapping[str, Plugin], name: str | None, parameter: str
) -> tuple[Scorer, ...]:
    """The named prefix scorer, or every declared one (none is allowed)."""
    if name is not None:
        plugin = plugins.get(name)
        if plugin is None:
            raise ValueError(f"{parameter} {name!r} names no declared plugin")
        inner = getattr(plugin, "source", None)
        if getattr(plugin, "kind", None) == "producer" and isinstance(inner, Scorer):
            return (inner,)
        if plugin.type not in PREFIX_SCORER_TYPES or not isinstance(plugin, Scorer):
            raise ValueError(
                f"{parameter} {name!r} is a {plugin.type!r}; {owner} needs a "
                + " or ".join(PREFIX_SCORER_TYPES)
            )
        return (plugin,)
    return tuple(
        p for p in plugins.values() if p.type in PREFIX_SCORER_TYPES and isinstance(p, Scorer)
    )


def cached_fraction(
    cycle: CycleState, request: LLMRequest, scorers: Sequence[Scorer], endpoint: EndpointState
) -> float:
    """The share of the prompt `endpoint` holds, by the best-informed prefix scorer (0 without one)."""
    best = 0.0
    for scorer in scorers:
        score = prefix_scores(cycle, scorer, request, [endpoint])[0]
        if score > best:
            best = score
    return best if best < 1.0 else 1.0


def precise_cached_tokens(
    request: LLMRequest, scorers: Sequence[Scorer], endpoint: EndpointState
) -> int:
    """Prompt tokens `endpoint` holds by a precise index, in any tier and unweighted (as
    llm-d's decider counts them: a block offloaded to CPU still saves its whole prefill)."""
    from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer

    tokens = request.cache.get("token_ids")
    if tokens is None:
        return 0
    best = 0
    for scorer in scorers:
        source: object = scorer
        producer = getattr(scorer, "producer", None)
        if producer is not None:
            source = getattr(producer, "source", scorer)
        if not isinstance(source, PrecisePrefixCacheScorer):
            continue
        index = source.index
        size = index.block_size(endpoint.address) or 0
        best = max(best, index.matched_blocks(endpoint.address, tokens, request.lora) * size)
    return best


class PrefixDeciderParameters(Parameters):
    non_cached_tokens: int = Field(0, alias="nonCachedTokens", ge=0)
    prompt_tokens: int = Field(0, alias="promptTokens", ge=0)
    """Prompts shorter than this (in tokens) never disaggregate; 0 = no such gate."""
    prefix_plugin_name: str | None = Field(None, alias="prefixPluginName", min_length=1)
    prefix_match_info_producer_name: str | None = Field(
        None, alias="prefixMatchInfoProducerName", min_length=1
    )
    """The current llm-d name of the reference: the prefix producer whose match it reads."""
    prefix_plugin_type: str | None = Field(None, alias="prefixPluginType")
    """Older llm-d field; accepted and unused (the named plugin says its type)."""

    @model_validator(mode="after")
    def _one_reference(self) -> Self:
        if self.prefix_plugin_name is not None and self.prefix_match_info_producer_name:
            raise ValueError(
                "prefixPluginName and prefixMatchInfoProducerName name the same thing; keep one"
            )
        return self


class PrefixBasedPDDecider:
    """`prefix-based-pd-decider`: disaggregate when the decode endpoint lacks enough of the prompt.

    `uncached = prompt_tokens − round(f × prompt_tokens)`, `f` the decode endpoint's
    prefix score (matched leading blocks / prompt blocks) from the prefix scorer or
    producer named by `prefixPluginName` / `prefixMatchInfoProducerName`, else the
    highest of every declared prefix scorer, else 0 (the whole prompt counts as
    uncached). Disaggregate when `uncached ≥ nonCachedTokens`. As in llm-d (since
    v0.6): `nonCachedTokens: 0` never disaggregates; a prompt shorter than
    `nonCachedTokens` or than `promptTokens` never does.
    """

    __slots__ = ("name", "non_cached_tokens", "prefix_plugin_name", "prompt_tokens", "scorers")
    type: ClassVar[str] = "prefix-based-pd-decider"

    def __init__(
        self,
        name: str | None = None,
        non_cached_tokens: int = 0,
        prefix_plugin_name: str | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        self.name = name or self.type
        self.non_cached_tokens = non_cached_tokens
        self.prefix_plugin_name = prefix_plugin_name
        self.prompt_tokens = prompt_tokens
        self.scorers: tuple[Scorer, ...] = ()

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(PrefixDeciderParameters, cls.type, name, parameters)
        return cls(
            name,
            p.non_cached_tokens,
            p.prefix_plugin_name or p.prefix_match_info_producer_name,
            p.prompt_tokens,
        )

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.scorers = _prefix_scorers(
            self.type, plugins, self.prefix_plugin_name, "prefixPluginName"
        )

    def uncached_tokens(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> int:
        n = request.prompt_tokens
        cached = round(cached_fraction(cycle, request, self.scorers, decode) * n)
        return n - max(cached, min(n, precise_cached_tokens(request, self.scorers, decode)))

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> bool:
        threshold = self.non_cached_tokens
        if threshold <= 0:
            return False
        if request.prompt_tokens < threshold or request.prompt_tokens < self.prompt_tokens:
            return False
        return self.uncached_tokens(cycle, request, decode) >= threshold

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, nonCachedTokens={self.non_cached_tokens})"
        )


class AlwaysDisaggPDDecider(ParameterlessPlugin):
    """`always-disagg-pd-decider`: every request gets a separate prefill leg."""

    __slots__ = ()
    type: ClassVar[str] = "always-disagg-pd-decider"

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> bool:
        return True


MULTIMODAL_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video"}
)
"""Chat content part types that carry an image, audio or video input."""


def has_multimodal_input(request: LLMRequest) -> bool:
    """Whether a chat request's messages carry image, audio or video parts."""
    for message in request.messages or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in MULTIMODAL_PART_TYPES:
                    return True
    return False


class AlwaysDisaggMultimodalDecider(ParameterlessPlugin):
    """`always-disagg-multimodal-decider`: an encode stage for every request with multimodal
    inputs (image, audio or video parts in its chat messages), none for text."""

    __slots__ = ()
    type: ClassVar[str] = "always-disagg-multimodal-decider"

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> bool:
        return has_multimodal_input(request)


class CharThresholdDecider:
    """The rule of llm-d's early `pd-profile-handler`: uncached prompt *characters* ≥ `threshold`.

    Not registered: `pd-profile-handler` builds it from its own `threshold` parameter.
    """

    __slots__ = ("name", "prefix_plugin_name", "scorers", "threshold")
    type: ClassVar[str] = "pd-profile-handler-threshold"

    def __init__(self, name: str, threshold: int, prefix_plugin_name: str | None = None) -> None:
        self.name = name
        self.threshold = threshold
        self.prefix_plugin_name = prefix_plugin_name
        self.scorers: tuple[Scorer, ...] = ()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.scorers = _prefix_scorers(
            "pd-profile-handler", plugins, self.prefix_plugin_name, "prefixPluginName"
        )

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode: EndpointState) -> bool:
        if self.threshold <= 0:
            return True
        chars = len(request.prompt)
        if chars < self.threshold:
            return False
        uncached = (1.0 - cached_fraction(cycle, request, self.scorers, decode)) * chars
        return uncached >= self.threshold


# -- the P/D profile handler --------------------------------------------------------------


class ProfileNames(Parameters):
    decode: str | None = Field(None, min_length=1)
    prefill: str | None = Field(None, min_length=1)
    encode: str | None = Field(None, min_length=1)


class DeciderNames(Parameters):
    prefill: str | None = Field(None, min_length=1)
    encode: str | None = Field(None, min_length=1)


class DisaggHandlerParameters(Parameters):
    profiles: ProfileNames | None = None
    deciders: DeciderNames | None = None
    decode_profile: str | None = Field(None, alias="decodeProfile", min_length=1)
    prefill_profile: str | None = Field(None, alias="prefillProfile", min_length=1)
    encode_profile: str | None = Field(None, alias="encodeProfile")
    prefill_decider_plugin_name: str | None = Field(
        None, alias="prefillDeciderPluginName", min_length=1
    )
    decider_plugin_name: str | None = Field(None, alias="deciderPluginName", min_length=1)
    encode_decider_plugin_name: str | None = Field(
        None, alias="encodeDeciderPluginName", min_length=1
    )
    prefix_plugin_type: str | None = Field(None, alias="prefixPluginType")
    prefix_plugin_name: str | None = Field(None, alias="prefixPluginName")
    primary_port: int = Field(0, alias="primaryPort", ge=0, le=65535)
    stage_order: Literal["decode-first"] = Field("decode-first", alias="stageOrder")
    """llm-d's `prefill-first` order is not implemented; `decode-first` is its default."""

    @model_validator(mode="after")
    def _one_spelling(self) -> Self:
        flat = (
            self.decode_profile,
            self.prefill_profile,
            self.prefill_decider_plugin_name,
            self.decider_plugin_name,
        )
        if any(v is not None for v in flat) and (
            self.profiles is not None or self.deciders is not None
        ):
            raise ValueError(
                "cannot mix the deprecated flat parameters (decodeProfile, prefillProfile, "
                "deciderPluginName, prefillDeciderPluginName) with profiles/deciders; use one form"
            )
        if self.prefill_decider_plugin_name and self.decider_plugin_name:
            raise ValueError(
                "prefillDeciderPluginName and deciderPluginName name the same decider; keep one"
            )
        if (self.encode_profile or self.encode_decider_plugin_name) and (
            self.profiles is not None or self.deciders is not None
        ):
            raise ValueError(
                "cannot mix the deprecated flat parameters (encodeProfile, "
                "encodeDeciderPluginName) with profiles/deciders; use one form"
            )
        return self

    def encode_names(self) -> tuple[str, str | None]:
        """(encode profile, encode decider plugin name)."""
        profiles = self.profiles or ProfileNames()
        deciders = self.deciders or DeciderNames()
        return (
            profiles.encode or self.encode_profile or DEFAULT_ENCODE_PROFILE,
            deciders.encode or self.encode_decider_plugin_name,
        )

    def names(self) -> tuple[str, str, str | None]:
        """(decode profile, prefill profile, decider plugin name)."""
        profiles = self.profiles or ProfileNames()
        deciders = self.deciders or DeciderNames()
        return (
            profiles.decode or self.decode_profile or DEFAULT_DECODE_PROFILE,
            profiles.prefill or self.prefill_profile or DEFAULT_PREFILL_PROFILE,
            deciders.prefill or self.prefill_decider_plugin_name or self.decider_plugin_name,
        )


class PdHandlerParameters(Parameters):
    decode_profile: str = Field(DEFAULT_DECODE_PROFILE, alias="decodeProfile", min_length=1)
    prefill_profile: str = Field(DEFAULT_PREFILL_PROFILE, alias="prefillProfile", min_length=1)
    decider_plugin_name: str | None = Field(None, alias="deciderPluginName", min_length=1)
    threshold: int | None = Field(None, ge=0)
    hash_block_size: int | None = Field(None, alias="hashBlockSize", gt=0)
    prefix_plugin_type: str | None = Field(None, alias="prefixPluginType")
    prefix_plugin_name: str | None = Field(None, alias="prefixPluginName", min_length=1)
    primary_port: int = Field(0, alias="primaryPort", ge=0, le=65535)

    @model_validator(mode="after")
    def _one_rule(self) -> Self:
        if self.decider_plugin_name is not None and self.threshold is not None:
            raise ValueError("give either deciderPluginName or the older threshold rule, not both")
        return self


def _first_other(ranked: list[EndpointState], other: EndpointState) -> EndpointState | None:
    for state in ranked:
        if state is not other:
            return state
    return None


class DisaggProfileHandler:
    """`disagg-profile-handler`: decode profile first, then encode and prefill if their deciders say so.

    As llm-d's decode-first order: the decode profile runs; if an encode profile and
    decider are configured and the decider wants an encode stage (multimodal
    inputs), the encode profile runs; then, if the prefill decider wants a separate
    prefill, the prefill profile. No prefill when the request is an embedding, the
    decider says no, the prefill profile finds no endpoint, or its only choice is
    the decode endpoint itself; the decision is then `decode-only`. Without a
    decider a stage never runs (its profile may still be declared, as in llm-d).
    """

    __slots__ = (
        "decider",
        "decider_name",
        "decode_profile",
        "encode_decider",
        "encode_decider_name",
        "encode_profile",
        "encoders_per_request",
        "name",
        "prefill_profile",
        "primary_port",
    )
    type: ClassVar[str] = "disagg-profile-handler"

    def __init__(
        self,
        name: str | None = None,
        decode_profile: str = DEFAULT_DECODE_PROFILE,
        prefill_profile: str = DEFAULT_PREFILL_PROFILE,
        decider: PDDecider | None = None,
        primary_port: int | None = None,
        decider_name: str | None = None,
        encode_profile: str = DEFAULT_ENCODE_PROFILE,
        encode_decider_name: str | None = None,
    ) -> None:
        self.name = name or self.type
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.decider = decider
        self.decider_name = decider_name
        self.primary_port = primary_port
        self.encode_profile = encode_profile
        self.encode_decider_name = encode_decider_name
        self.encode_decider: PDDecider | None = None
        self.encoders_per_request = 1

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(DisaggHandlerParameters, cls.type, name, parameters)
        decode, prefill, decider = p.names()
        encode, encode_decider = p.encode_names()
        return cls(
            name, decode, prefill, None, p.primary_port or None, decider, encode, encode_decider
        )

    def _decider(self, plugins: Mapping[str, Plugin], name: str, stage: str) -> PDDecider:
        plugin = plugins.get(name)
        if plugin is None:
            raise ValueError(
                f"the {stage} decider {name!r} names no declared plugin; declare it (for "
                "example prefix-based-pd-decider or always-disagg-multimodal-decider) or fix "
                "the name"
            )
        if not isinstance(plugin, PDDecider):
            raise ValueError(
                f"the {stage} decider {name!r} is a {plugin.type!r}, not a decider "
                "(prefix-based-pd-decider, always-disagg-pd-decider, "
                "always-disagg-multimodal-decider)"
            )
        return plugin

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        if self.decider_name is not None:
            self.decider = self._decider(plugins, self.decider_name, "prefill")
        if self.encode_decider_name is not None:
            self.encode_decider = self._decider(plugins, self.encode_decider_name, "encode")

    def check_profiles(self, profiles: Mapping[str, SchedulerProfile]) -> None:
        names = ", ".join(profiles) or "none"
        if self.decode_profile not in profiles:
            raise ValueError(
                f"runs the decode profile {self.decode_profile!r} first, but the scheduling "
                f"profiles are: {names}; add it or name the decode profile in the parameters"
            )
        wants_prefill = self.decider is not None or self.decider_name is not None
        if wants_prefill and self.prefill_profile not in profiles:
            raise ValueError(
                f"has a prefill decider but no prefill profile {self.prefill_profile!r} "
                f"(profiles: {names}); add it or name the prefill profile in the parameters"
            )
        if self.encode_decider_name is not None and self.encode_profile not in profiles:
            raise ValueError(
                f"has an encode decider but no encode profile {self.encode_profile!r} "
                f"(profiles: {names}); add it or name the encode profile in the parameters"
            )
        stages = (self.decode_profile, self.prefill_profile, self.encode_profile)
        extra = [p for p in profiles if p not in stages]
        if extra:
            raise ValueError(
                f"never runs profile(s) {', '.join(extra)}; it runs only "
                f"{self.decode_profile!r}, {self.prefill_profile!r} and {self.encode_profile!r}"
            )
        encode = profiles.get(self.encode_profile)
        limit = getattr(encode.picker, "max_num_of_endpoints", None) if encode else None
        self.encoders_per_request = limit or 1

    def startup_warnings(self) -> list[str]:
        out = []
        label = f"profile handler {self.name!r}"
        if self.decider is None and self.decider_name is None:
            out.append(
                f"{label}: no prefill decider, so every request is decode-only (a prefill "
                "profile, if declared, never runs)"
            )
        return out

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if self.decode_profile not in results:
            return [self.decode_profile]
        decode = results[self.decode_profile]
        if decode is None:
            return []
        target = decode.ranked[0]
        if (
            self.encode_decider is not None
            and self.encode_profile in profiles
            and self.encode_profile not in results
            and cycle.data.get(self._encode_key) is None
        ):
            wanted = self.encode_decider.disaggregate(cycle, request, target)
            cycle.data[self._encode_key] = wanted
            if wanted:
                return [self.encode_profile]
        if (
            self.prefill_profile in results
            or self.decider is None
            or request.kind is RequestKind.EMBEDDING
        ):
            return []
        if self.decider.disaggregate(cycle, request, target):
            return [self.prefill_profile]
        return []

    @property
    def _encode_key(self) -> str:
        return f"disagg/{self.name}/encode-decided"

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        decode = results.get(self.decode_profile)
        if decode is None or not decode.ranked:
            return None
        target = decode.ranked[0]
        prefill = results.get(self.prefill_profile)
        chosen = _first_other(prefill.ranked, target) if prefill is not None else None
        kept: dict[str, ProfileResult] = {self.decode_profile: decode}
        if chosen is not None and prefill is not None:
            kept[self.prefill_profile] = prefill
        encode = results.get(self.encode_profile)
        encoders: list[EndpointState] = []
        if encode is not None and encode.ranked:
            encoders = encode.ranked[: self.encoders_per_request]
            kept[self.encode_profile] = encode
        return Decision(
            endpoint=target,
            fallbacks=decode.ranked[1:],
            prefill=chosen,
            profile=self.decode_profile,
            results=kept,
            pd_decision=PREFILL_DECODE if chosen is not None else DECODE_ONLY,
            primary_port=self.primary_port,
            encoders=encoders,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PdProfileHandler(DisaggProfileHandler):
    """`pd-profile-handler`: llm-d's older name, with its own parameters.

    The decider is `deciderPluginName`; without one, the built-in rule of the first
    versions: prefill when uncached prompt characters ≥ `threshold` (0, the default,
    always prefills). `hashBlockSize` and `prefixPluginType` are accepted and unused
    (the prefix scorer has its own block size).
    """

    __slots__ = ()
    type: ClassVar[str] = "pd-profile-handler"

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(PdHandlerParameters, cls.type, name, parameters)
        decider: PDDecider | None = None
        if p.decider_plugin_name is None:
            decider = CharThresholdDecider(
                f"{name}/threshold", p.threshold or 0, p.prefix_plugin_name
            )
        return cls(
            name,
            p.decode_profile,
            p.prefill_profile,
            decider,
            p.primary_port or None,
            p.decider_plugin_name,
        )

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        if isinstance(self.decider, CharThresholdDecider):
            self.decider.bind_plugins(plugins)
            return
        super().bind_plugins(plugins)


# -- data parallelism behind a sidecar ----------------------------------------------------


class DataParallelParameters(Parameters):
    primary_port: int = Field(DEFAULT_DP_PRIMARY_PORT, alias="primaryPort", ge=1, le=65535)
    rank_header: bool = Field(False, alias="rankHeader")
    """servegate: vLLM's single-API-server data parallelism (`--data-parallel-size N`,
    one API server): the request goes to the endpoint's own URL with
    `X-data-parallel-rank` naming its least-loaded rank; `primaryPort` is not used."""

    @model_validator(mode="after")
    def _one_mode(self) -> Self:
        if self.rank_header and "primary_port" in self.model_fields_set:
            raise ValueError(
                "rankHeader (ranks behind one API server) and primaryPort (a sidecar in front "
                "of rank ports) are two different deployments; keep one"
            )
        return self


class DataParallelProfileHandler:
    """`data-parallel-profile-handler`: one profile picks a rank; the sidecar on `primaryPort`
    serves it. With `rankHeader` (servegate) the profile picks an API server and the
    gateway names its least-loaded data-parallel rank in `X-data-parallel-rank`."""

    __slots__ = ("name", "primary_port", "rank_header")
    type: ClassVar[str] = "data-parallel-profile-handler"

    def __init__(
        self,
        name: str | None = None,
        primary_port: int = DEFAULT_DP_PRIMARY_PORT,
        rank_header: bool = False,
    ):
        self.name = name or self.type
        self.primary_port = primary_port
        self.rank_header = rank_header

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(DataParallelParameters, cls.type, name, parameters)
        return cls(name, p.primary_port, p.rank_header)

    def check_profiles(self, profiles: Mapping[str, SchedulerProfile]) -> None:
        if len(profiles) != 1:
            raise ValueError(
                f"runs exactly one scheduling profile, but {len(profiles)} are configured "
                f"({', '.join(profiles) or 'none'}); keep one"
            )

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        return [] if results else list(profiles)

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        for name, result in results.items():
            if result is None or not result.ranked:
                return None
            return Decision(
                endpoint=result.ranked[0],
                fallbacks=result.ranked[1:],
                profile=name,
                results={name: result},
                primary_port=None if self.rank_header else self.primary_port,
                rank_header=self.rank_header,
            )
        return None


# -- llm-d's sidecar header plugins ----------------------------------------------------------


class HeadersHandlerParameters(Parameters):
    prefill_profile: str = Field(DEFAULT_PREFILL_PROFILE, alias="prefillProfile", min_length=1)
    encode_profile: str | None = Field(None, alias="encodeProfile")


class DisaggHeadersHandler:
    """`disagg-headers-handler` (`prefill-header-handler`): the sidecar protocol is in use.

    The gateway writes `x-prefiller-host-port` itself (`gateway/disagg.py`), as it does
    for every P/D decision unless `disaggregation.mode` is `gateway`.
    `prefillProfile` must name the P/D handler's prefill profile; `encodeProfile` is
    accepted and unused (servegate has no encode stage).
    """

    __slots__ = ("name", "prefill_profile")
    type: ClassVar[str] = "disagg-headers-handler"

    def __init__(self, name: str | None = None, prefill_profile: str = DEFAULT_PREFILL_PROFILE):
        self.name = name or self.type
        self.prefill_profile = prefill_profile

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(HeadersHandlerParameters, cls.type, name, parameters)
        return cls(name, p.prefill_profile)

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        for plugin in plugins.values():
            if (
                isinstance(plugin, DisaggProfileHandler)
                and plugin.prefill_profile != self.prefill_profile
            ):
                raise ValueError(
                    f"prefillProfile {self.prefill_profile!r} is not the prefill profile "
                    f"{plugin.prefill_profile!r} of {plugin.name!r}; make them the same"
                )


LEGACY_HEADERS_HANDLER_TYPE = "prefill-header-handler"
"""llm-d's older name of `disagg-headers-handler`; accepted as an alias."""
