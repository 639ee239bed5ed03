"""Seeded request sets: what every target in a comparison receives, byte for byte.

A workload is a frozen dataclass of its shape with `generate(model, api, seed)`; the
same arguments always give the same requests. Lengths are in tokens as `text`
defines them (one word ≈ one token).

- `shared-prefix` (inference-perf's shape): `num_groups` system prompts of
  `system_prompt_len` tokens, each followed by `prompts_per_group` distinct questions
  of `question_len` tokens; shuffled, so a router has to find the groups.
- `multi-turn`: `sessions` conversations of `turns` turns. Turn k carries the whole
  history (system prompt, earlier questions and synthesized answers of `output_len`
  tokens) plus a new question, and the header `x-session-id`. The runner sends turn k
  only after turn k-1 of that session completed, so its prompt is in cache when a
  router sends it to the same replica. Answers are synthesized rather than taken from
  the replies so every target gets identical requests.
- `lora-mix`: prompts addressed to LoRA adapters chosen with Zipf weights
  1/(rank+1)^skew, so the first adapter is the most popular.
- `random`: independent prompts with lengths uniform in len·(1 ± spread).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import orjson

from servegate.bench import text

SESSION_HEADER = "x-session-id"


class Api(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def _frozen_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType({k.lower(): v for k, v in headers.items()})


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload or trace; `timestamp` is seconds from the trace start."""

    model: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a bench request needs exactly one of `prompt` or `messages`")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "headers", _frozen_headers(self.headers))

    @property
    def api(self) -> Api:
        return Api.COMPLETIONS if self.prompt is not None else Api.CHAT

    @property
    def path(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"

    @property
    def session_id(self) -> str | None:
        return self.headers.get(SESSION_HEADER)

    @property
    def prompt_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m.content for m in self.messages or ())

    def body(self, *, stream: bool, ignore_eos: bool = False) -> bytes:
        payload: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
        if self.prompt is not None:
            payload["prompt"] = self.prompt
        else:
            payload["messages"] = [
                {"role": m.role, "content": m.content} for m in self.messages or ()
            ]
        payload["stream"] = stream
        if stream:
            payload["stream_options"] = {"include_usage": True}
        if ignore_eos:
            payload["ignore_eos"] = True
        return orjson.dumps(payload)

    def tagged(self, tag: str) -> BenchRequest:
        """The same request with `tag` put in front of its first text.

        Targets that share replicas would otherwise reuse each other's cached
        prefixes; a tag per target keeps their prompt prefixes disjoint.
        """
        if self.prompt is not None:
            return replace(self, prompt=tag + self.prompt)
        first, *rest = self.messages or ()
        return replace(self, messages=(ChatMessage(first.role, tag + first.content), *rest))


class Workload(Protocol):
    @property
    def name(self) -> str: ...

    def generate(self, *, model: str, api: Api, seed: int) -> list[BenchRequest]: ...


def _require_positive(owner: str, **values: float) -> None:
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{owner}: {key} must be >= 1, got {value}")


def _request(
    model: str, api: Api, system: str, user: str, max_tokens: int, headers: Mapping[str, str]
) -> BenchRequest:
    if api is Api.CHAT:
        messages: tuple[ChatMessage, ...] = (ChatMessage("user", user),)
        if system:
            messages = (ChatMessage("system", system), *messages)
        return BenchRequest(model, max_tokens, messages=messages, headers=headers)
    prompt = f"{system} {user}" if system else user
    return BenchRequest(model, max_tokens, prompt=prompt, headers=headers)


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    name: ClassVar[str] = "shared-prefix"
    num_groups: int = 8
    prompts_per_group: int = 16
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 32

    def __post_init__(self) -> None:
        _require_positive(
            self.name,
            num_groups=self.num_groups,
            prompts_per_group=self.prompts_per_group,
            system_prompt_len=self.system_prompt_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )

    def generate(self, *, model: str, api: Api, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        requests: list[BenchRequest] = []
        for _ in range(self.num_groups):
            system = text.words(rng, self.system_prompt_len)
            for _ in range(self.prompts_per_group):
                question = text.words(rng, self.question_len)
                requests.append(_request(model, api, system, question, self.output_len, {}))
        rng.shuffle(requests)
        return requests


@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    name: ClassVar[str] = "multi-turn"
    sessions: int = 8
    turns: int = 4
    system_prompt_len: int = 128
    question_len: int = 64
    output_len: int = 32

    def __post_init__(self) -> None:
        _require_positive(
            self.name,
            sessions=self.sessions,
            turns=self.turns,
            system_prompt_len=self.system_prompt_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )

    def generate(self, *, model: str, api: Api, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        histories = [
            [ChatMessage("system", text.words(rng, self.system_prompt_len))]
            for _ in range(self.sessions)
        ]
        requests: list[BenchRequest] = []
        for _ in range(self.turns):
            for index, history in enumerate(histories):
                history.append(ChatMessage("user", text.words(rng, self.question_len)))
                headers = {SESSION_HEADER: f"session-{seed}-{index}"}
                requests.append(self._request(model, api, history, headers))
                history.append(ChatMessage("assistant", text.words(rng, self.output_len)))
        return requests

    def _request(
        self,
        model: str,
        api: Api,
        history: Sequence[ChatMessage],
        headers: Mapping[str, str],
    ) -> BenchRequest:
        if api is Api.CHAT:
            return BenchRequest(model, self.output_len, messages=tuple(history), headers=headers)
        prompt = "\n".join(f"{m.role}: {m.content}" for m in history) + "\nassistant:"
        return BenchRequest(model, self.output_len, prompt=prompt, headers=headers)


def zipf_weights(count: int, skew: float) -> list[float]:
    """Normalised weights 1/(rank+1)^skew for ranks 0..count-1; skew 0 is uniform."""
    raw = [1.0 / (rank + 1) ** skew for rank in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True, slots=True)
class LoraMixWorkload:
    name: ClassVar[str] = "lora-mix"
    adapters: tuple[str, ...]
    skew: float = 1.0
    num_requests: int = 128
    prompt_len: int = 256
    output_len: int = 32

    def __post_init__(self) -> None:
        if not self.adapters:
            raise ValueError(f"{self.name}: give at least one adapter name")
        if self.skew < 0:
            raise ValueError(f"{self.name}: skew must be >= 0, got {self.skew}")
        _require_positive(
            self.name,
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
        )

    def generate(self, *, model: str, api: Api, seed: int) -> list[BenchRequest]:
        """`model` is unused: each request names an adapter."""
        rng = random.Random(seed)
        chosen = rng.choices(
            self.adapters, weights=zipf_weights(len(self.adapters), self.skew), k=self.num_requests
        )
        return [
            _request(adapter, api, "", text.words(rng, self.prompt_len), self.output_len, {})
            for adapter in chosen
        ]


@dataclass(frozen=True, slots=True)
class RandomWorkload:
    name: ClassVar[str] = "random"
    num_requests: int = 128
    prompt_len: int = 256
    output_len: int = 32
    spread: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.spread < 1:
            raise ValueError(f"{self.name}: spread must be in [0, 1), got {self.spread}")
        _require_positive(
            self.name,
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
        )

    def _length(self, rng: random.Random, mean: int) -> int:
        low = round(mean * (1 - self.spread))
        high = round(mean * (1 + self.spread))
        return max(1, rng.randint(low, high))

    def generate(self, *, model: str, api: Api, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        requests = []
        for _ in range(self.num_requests):
            prompt = text.words(rng, self._length(rng, self.prompt_len))
            max_tokens = self._length(rng, self.output_len)
            requests.append(_request(model, api, "", prompt, max_tokens, {}))
        return requests


def with_poisson_timestamps(
    requests: Sequence[BenchRequest], rate: float, seed: int
) -> list[BenchRequest]:
    """Arrival times of a Poisson process at `rate` requests/s, starting at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    now = 0.0
    stamped = []
    for index, request in enumerate(requests):
        if index:
            now += rng.expovariate(rate)
        stamped.append(replace(request, timestamp=now))
    return stamped
