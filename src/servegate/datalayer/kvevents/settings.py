"""Where the KV-event subscribers listen: the pool's settings, else llm-d's plugin config.

The precise prefix scorer's parameters may carry llm-d's `kvEventsConfig`; reading
them here (not in the plugin) keeps the scheduler free of transport settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from servegate.config import KVEventsPoolSettings
from servegate.curve import CurveSettings
from servegate.scheduling.framework import Plugin
from servegate.scheduling.prefix.precise import precise_owners


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """Where replicas publish, when their endpoints do not say."""

    port: int | None = None
    """Derive `tcp://<replica host>:<port>` for replicas without their own endpoint."""
    replay_port: int | None = None
    """Derive the replay socket `tcp://<host>:<replay_port>` the same way."""
    topic_filter: str = ""
    """ZMQ subscription prefix; "" receives every topic."""
    bind_endpoint: str | None = None
    """A SUB socket to bind for all replicas (`tcp://*:5557`, `tcp://127.0.0.1:5557`)."""
    replay_timeout_s: float = 2.0
    curve: CurveSettings | None = None
    """CURVE: a bound socket admits only authorized publisher keys; with `server_key_file`
    set, per-replica (connected) sockets are CURVE clients of publishers holding that key
    (relays that are CURVE servers); without it they stay plain, as vLLM publishes."""
    allow_unauthenticated_bind: bool = False
    """Run a bind socket without `curve`: messages are accepted only from the TCP address of
    the pool member their topic names. Without this (or `curve`) bind mode stays off."""
    auto: bool = False
    """Nothing configured: `port` is llm-d's convention, used for replicas alone on their
    host, and a topic that names another replica is dropped."""


AUTO_PORT = 5557


def kv_events_settings(
    plugins: Mapping[str, Plugin], pool: KVEventsPoolSettings
) -> KVEventsSettings:
    """The subscribers' settings: the pool's `kv_events`, else llm-d's `kvEventsConfig`,
    else llm-d's convention (`auto`: port 5557 of each replica's host)."""
    if pool.port is not None or pool.bind is not None:
        return KVEventsSettings(
            port=pool.port,
            replay_port=pool.replay_port,
            topic_filter=pool.topic_filter,
            bind_endpoint=pool.bind,
            replay_timeout_s=pool.replay_timeout_s,
            curve=pool.curve,
            allow_unauthenticated_bind=pool.allow_unauthenticated_bind,
        )
    for plugin in precise_owners(plugins).values():
        llmd = plugin.params.kv_events_config
        if llmd is None or not (llmd.discover_pods or llmd.zmq_endpoint):
            continue
        discovery = llmd.pod_discovery_config
        return KVEventsSettings(
            port=(discovery.socket_port if discovery else 5557) if llmd.discover_pods else None,
            replay_port=pool.replay_port,
            topic_filter=llmd.topic_filter,
            bind_endpoint=llmd.zmq_endpoint or None,
            replay_timeout_s=pool.replay_timeout_s,
            curve=pool.curve,
            allow_unauthenticated_bind=pool.allow_unauthenticated_bind,
        )
    return KVEventsSettings(
        port=AUTO_PORT,
        replay_port=pool.replay_port,
        topic_filter=pool.topic_filter,
        replay_timeout_s=pool.replay_timeout_s,
        curve=pool.curve,
        auto=True,
    )
