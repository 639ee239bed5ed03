"""How the gateway tokenises for routing, defined once: the config's `tokenizer` (per pool
and per model) is this model, and the tokenizers read it as it is."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TokenizerSettings(BaseModel):
    """How the gateway turns a request into the token ids the engine will see (for
    prefix routing): learned per model from the replicas (`auto`, the default: the
    model folder named by `/v1/models` when readable, else the engine's `/tokenize`,
    prefix-cached), a HuggingFace folder (`hf`, with its chat template), the engine's
    own `/tokenize` (`engine`, cached per body, `fallback` on failure), the
    simulator's built-in tokenizer (`simulator`), or no ids (`chars`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["auto", "hf", "engine", "simulator", "chars"] = "auto"
    path: str | None = None
    """The HuggingFace tokenizer folder (tokenizer.json, tokenizer_config.json)."""
    fallback: Literal["hf", "simulator", "chars"] = "chars"
    """For `engine`: what to use when `/tokenize` fails or times out."""
    cache_size: int = Field(8192, ge=0)
    """For `engine`: request bodies whose token ids are remembered; for `auto`: prompt
    chunks and conversation prefixes."""
    timeout_s: float = Field(2.0, gt=0)
    """For `engine`: the longest a `/tokenize` call may take."""

    @property
    def local_source(self) -> str:
        """The source that answers without asking a replica: `source`, or for `engine` its
        `fallback` (`hf` and `simulator` are local tokenizers; the others give none)."""
        return self.fallback if self.source == "engine" else self.source

    @model_validator(mode="after")
    def _needs_path(self) -> TokenizerSettings:
        if (self.source == "hf" or self.fallback == "hf") and not self.path:
            raise ValueError("an `hf` tokenizer needs `path`: the folder with tokenizer.json")
        return self
