"""llm-d's request parsers (`requestHandler.parsers`), mapped onto servegate's request parsing.

In llm-d a parser plugin claims request paths and turns bodies into the
scheduler's request view. servegate's gateway parses requests itself: the
OpenAI routes it serves are parsed as `openai-parser` parses them (model,
prompt or messages, stream, max tokens), so `openai-parser` is implemented.
The other parsers claim protocols or paths servegate's gateway does not parse
through a parser plugin; each is accepted with a startup warning saying so.
"""

from __future__ import annotations

from typing import ClassVar

from servegate.scheduling.declared import DeclaredPlugin

PARSER_KIND = "parser"


class _Parser(DeclaredPlugin):
    __slots__ = ()
    kind: ClassVar[str] = PARSER_KIND
    paths: ClassVar[tuple[str, ...]] = ()
    """The request paths upstream's parser claims (suffixes); empty = every path."""


class OpenAIParser(_Parser):
    """`openai-parser`: OpenAI request bodies, which is what servegate's gateway parses."""

    __slots__ = ()
    type: ClassVar[str] = "openai-parser"
    paths: ClassVar[tuple[str, ...]] = (
        "v1/chat/completions",
        "v1/completions",
        "v1/embeddings",
        "v1/responses",
    )


class AnthropicParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "anthropic-parser"
    paths: ClassVar[tuple[str, ...]] = ("v1/messages",)
    unsupported: ClassVar[str] = (
        "servegate's gateway parses requests itself: POST /v1/messages is one of its routes "
        "(README, 'What it does'), routed by model; this parser adds nothing to that"
    )


class VllmHTTPParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "vllmhttp-parser"
    paths: ClassVar[tuple[str, ...]] = ("inference/v1/generate",)
    unsupported: ClassVar[str] = (
        "servegate's gateway does not parse vLLM's /inference/v1/generate (pre-tokenized) "
        "bodies; OpenAI routes are parsed as openai-parser does"
    )


class SGLangHTTPParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "sglanghttp-parser"
    paths: ClassVar[tuple[str, ...]] = ("generate",)
    unsupported: ClassVar[str] = (
        "servegate's gateway does not parse SGLang's native /generate bodies; OpenAI routes "
        "are parsed as openai-parser does"
    )


class PassthroughParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "passthrough-parser"
    unsupported: ClassVar[str] = (
        "servegate's gateway parses every body it routes and has no unparsed fallback path; "
        "requests on routes it does not serve are refused"
    )


class VllmGRPCParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "vllmgrpc-parser"
    unsupported: ClassVar[str] = (
        "servegate's gateway serves HTTP, not vLLM's gRPC API; there is nothing for this "
        "parser to parse"
    )


class VertexAIParser(_Parser):
    __slots__ = ()
    type: ClassVar[str] = "vertexai-parser"
    unsupported: ClassVar[str] = (
        "servegate's gateway serves HTTP, not the Vertex AI gRPC prediction API; there is "
        "nothing for this parser to parse"
    )


PARSERS: tuple[type[_Parser], ...] = (
    OpenAIParser,
    AnthropicParser,
    VllmHTTPParser,
    SGLangHTTPParser,
    PassthroughParser,
    VllmGRPCParser,
    VertexAIParser,
)
