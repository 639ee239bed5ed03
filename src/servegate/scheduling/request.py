"""LLMRequest: the parsed view of a request that routing needs.

The gateway parses the body once; plugins read these fields and never the raw
bytes. `cache` lets plugins share per-request work (token ids, block hashes)
computed by whichever plugin needs it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class RequestKind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RESPONSES = "responses"
    """OpenAI's Responses API (`/v1/responses`)."""
    MESSAGES = "messages"
    """Anthropic's Messages API (`/v1/messages`)."""
    OTHER = "other"
    """Any other body with a `model` (`/tokenize`, `/v1/rerank`, `/v1/audio/*`, …): routed
    by its model; its text, where it has any, feeds prefix-aware routing as a prompt."""


@dataclass(slots=True)
class LLMRequest:
    request_id: str
    kind: RequestKind
    model: str
    """The model name the client asked for."""
    target_model: str
    """The model name the replica will see (after aliases/rewrites)."""
    base_model: str
    """The pool's base model; equals `target_model` unless that is a LoRA adapter."""
    lora: str | None = None
    """The LoRA adapter requested, when `target_model` is one."""
    prompt: str = ""
    """Prompt text: the completion prompt, or the chat messages flattened in order."""
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    max_tokens: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    """Lower-cased request headers."""
    body: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    """Prompt length in tokens: exact when a tokenizer ran, else an estimate."""
    priority: int = 0
    fairness_id: str = ""
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def session_id(self) -> str | None:
        return self.headers.get("x-session-id")
