"""Model rewrites (the Gateway API Inference Extension's `InferenceModelRewrite`), defined
once: the config's `model_rewrites` are this model (config.py imports it), and so are the
cluster's objects that Kubernetes discovery reads (`pool/discovery/policy.py`);
`gateway/model_routing.py` turns them into the routing table.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servegate.scheduling.affinity import SESSION_ID_HEADER


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _match_model(value: Any) -> Any:
    """`{model: NAME}` (shorthand) or `{model: {type: Exact, value: NAME}}` (the CRD's)."""
    if isinstance(value, dict) and isinstance(value.get("model"), dict):
        inner = dict(value["model"])
        kind = inner.pop("type", "Exact")
        if kind != "Exact":
            raise ValueError(f"model match type {kind!r} is not supported; use Exact")
        if set(inner) != {"value"}:
            raise ValueError("a model match needs exactly `value` (and optionally `type`)")
        return {**value, "model": inner["value"]}
    return value


class ModelMatch(_Strict):
    model: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _crd_shape(cls, value: Any) -> Any:
        return _match_model(value)


class RewriteTarget(_Strict):
    target: str = Field(alias="modelRewrite", min_length=1)
    """The model name the replica sees."""
    weight: int = Field(1, ge=0)


class RewriteRule(_Strict):
    matches: tuple[ModelMatch, ...] = ()
    """Public model names this rule answers; empty = any model nothing else serves."""
    targets: tuple[RewriteTarget, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _weights(self) -> RewriteRule:
        if sum(t.weight for t in self.targets) <= 0:
            raise ValueError("target weights must add up to more than 0")
        names = [t.target for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"a target is listed twice in {names}")
        return self


class StickySettings(_Strict):
    header: str = Field(SESSION_ID_HEADER, min_length=1)
    """A session's requests (same header value) always get the same target."""


class ModelRewrite(_Strict):
    """Gateway API Inference Extension's `InferenceModelRewrite`, as its `spec` or the whole
    resource (`apiVersion`, `kind`, `metadata.name`, `spec`), plus `sticky`."""

    name: str | None = None
    pool_ref: str | None = Field(None, alias="poolRef")
    """Targets are looked up in this pool only; None = the first pool that serves each."""
    rules: tuple[RewriteRule, ...] = Field(min_length=1)
    sticky: StickySettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _resource_shape(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = dict(value)
        if "spec" in out:
            kind = out.pop("kind", "InferenceModelRewrite")
            if kind != "InferenceModelRewrite":
                raise ValueError(f"kind {kind!r}: only InferenceModelRewrite goes here")
            out.pop("apiVersion", None)
            metadata = out.pop("metadata", None) or {}
            spec = out.pop("spec")
            if not isinstance(spec, dict) or not isinstance(metadata, dict):
                raise ValueError("`spec` and `metadata` must be mappings")
            out = {**spec, **out}
            if "name" in metadata:
                out.setdefault("name", metadata["name"])
        ref = out.get("poolRef")
        if isinstance(ref, dict):
            if "name" not in ref or set(ref) - {"name", "group", "kind"}:
                raise ValueError("poolRef takes `name` (and optionally `group`, `kind`)")
            out["poolRef"] = ref["name"]
        return out
