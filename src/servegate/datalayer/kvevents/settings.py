"""Where the KV-event subscribers listen: the pool's settings, else llm-d's plugin config.

`KVEventsSettings` is defined once, here: it is the pool's `kv_events` in the config
(config.py imports it) and what the manager reads. The precise prefix scorer's
parameters may carry llm-d's `kvEventsConfig`; reading them here (not in the plugin)
keeps the scheduler free of transport settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servegate.curve import CurveSettings
from servegate.scheduling.framework import Plugin
from servegate.scheduling.prefix.precise import precise_owners

AUTO_PORT = 5557
AUTO_REPLAY_PORT = 5558
"""llm-d's convention for the publisher's replay ROUTER socket (vLLM's `replay_endpoint`
`tcp://*:5558`), asked in auto mode when the pool names no replay port."""


class KVEventsSettings(BaseModel):
    """Where replicas publish KV events when their endpoint entry does not say."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    port: int | None = Field(None, ge=1, le=65535)
    """Subscribe to `tcp://<replica host>:<port>` for every replica."""
    replay_port: int | None = Field(None, ge=1, le=65535)
    """Ask `tcp://<replica host>:<replay_port>` to replay batches lost to a gap."""
    topic_filter: str = ""
    """ZMQ subscription prefix; "" receives every topic."""
    bind: str | None = None
    """Bind one SUB socket (`tcp://*:5557`) that every replica publishes to instead; needs
    `curve` or `allow_unauthenticated_bind` (the topic alone would name the replica)."""
    replay_timeout_s: float = Field(2.0, gt=0)
    curve: CurveSettings | None = None
    """ZeroMQ CURVE keys: with `bind`, only publishers with an authorized key are heard; with
    `server_key_file`, per-replica sockets connect as CURVE clients to publishers holding that
    key (relays); docs/cache-routing.md."""
    allow_unauthenticated_bind: bool = False
    """`bind` without `curve`: believe a message only from the TCP address of the replica its
    topic names, with a warning at start."""

    @model_validator(mode="after")
    def _bind_is_authenticated(self) -> KVEventsSettings:
        if self.bind is not None and self.curve is None and not self.allow_unauthenticated_bind:
            raise ValueError(
                "kv_events.bind trusts the topic to name the replica: set kv_events.curve "
                "(authenticated publishers) or kv_events.allow_unauthenticated_bind: true, or "
                "use kv_events.port (the gateway connects to each replica's own socket)"
            )
        return self


class ChosenKVEvents(NamedTuple):
    """What the subscribers use, and whether it is llm-d's convention (nothing configured:
    `port` is used for replicas alone on their host, and a topic that names another
    replica is dropped)."""

    settings: KVEventsSettings
    auto: bool
    replay_optional: bool = False
    """The replay port is llm-d's guess, not configured: asked once, then given up."""


def kv_events_settings(plugins: Mapping[str, Plugin], pool: KVEventsSettings) -> ChosenKVEvents:
    """The subscribers' settings: the pool's `kv_events`, else llm-d's `kvEventsConfig`,
    else llm-d's convention (`auto`: port 5557 of each replica's host).

    llm-d's `zmqEndpoint` is taken as it is, even without authentication (`model_copy`
    does not validate): the manager then keeps bind mode off and says why."""
    if pool.port is not None or pool.bind is not None:
        return ChosenKVEvents(pool, auto=False)
    for plugin in precise_owners(plugins).values():
        llmd = plugin.params.kv_events_config
        if llmd is None or not (llmd.discover_pods or llmd.zmq_endpoint):
            continue
        discovery = llmd.pod_discovery_config
        port = (discovery.socket_port if discovery else 5557) if llmd.discover_pods else None
        chosen = pool.model_copy(
            update={
                "port": port,
                "topic_filter": llmd.topic_filter,
                "bind": llmd.zmq_endpoint or None,
            }
        )
        return ChosenKVEvents(chosen, auto=False)
    replay = AUTO_REPLAY_PORT if pool.replay_port is None else pool.replay_port
    return ChosenKVEvents(
        pool.model_copy(
            update={"port": AUTO_PORT, "replay_port": replay, "allow_unauthenticated_bind": False}
        ),
        auto=True,
        replay_optional=pool.replay_port is None,
    )
