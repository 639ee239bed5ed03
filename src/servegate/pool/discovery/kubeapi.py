"""The Kubernetes API as discovery needs it: GET a JSON object, stream a watch.

kubernetes-asyncio supplies what is hard to get right — kubeconfig contexts and
exec/OIDC credentials, the in-cluster service-account token (re-read as it
rotates) and CA, client certificates, proxies — and its aiohttp transport, the
HTTP stack the gateway already runs on. The list/watch protocol itself
(resourceVersion, bookmarks, 410 Gone) is servegate's, in `reflector.py`, because
the library's `Watch` re-watches from the same version after a 410 instead of
relisting. Every foreign exception is translated here into `KubeApiError` or
`ApiGone`, so nothing above this module sees aiohttp or kubernetes-asyncio types.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from servegate.pool.discovery.settings import IN_CLUSTER_NAMESPACE_FILE

JSON = dict[str, Any]


class KubeApiError(Exception):
    """A failed API call; `status` is the HTTP status (0 when none came back)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ApiGone(KubeApiError):
    """410 Gone: the resourceVersion is too old to watch from; list again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 410)


class KubeApi(Protocol):
    async def get(self, path: str, params: Mapping[str, str]) -> JSON: ...

    def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[JSON]:
        """Watch events (`{"type", "object"}`) until the server ends the stream."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the API server is and which namespace is ours by default."""

    api: KubeApi
    namespace: str
    source: str
    """`in-cluster` or the kubeconfig path, for logs."""


def _status_message(status: int, body: bytes) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return f"HTTP {status}: {doc['message']}"
    return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"


class AsyncioKubeApi:
    """`KubeApi` over kubernetes-asyncio's configured `ApiClient`."""

    def __init__(self, client: Any, request_timeout_s: float, watch_timeout_s: float) -> None:
        self._client = client
        self._request_timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._watch_timeout = aiohttp.ClientTimeout(
            sock_connect=request_timeout_s, sock_read=watch_timeout_s + request_timeout_s
        )

    async def _open(
        self, path: str, params: Mapping[str, str], timeout: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        try:
            response: aiohttp.ClientResponse = await self._client.call_api(
                path,
                "GET",
                query_params=list(params.items()),
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise KubeApiError(f"GET {path}: {type(exc).__name__}: {exc}") from exc
        if response.status >= 300:
            try:
                body = await response.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                body = b""
            finally:
                response.release()
            message = f"GET {path}: {_status_message(response.status, body)}"
            if response.status == 410:
                raise ApiGone(message)
            raise KubeApiError(message, response.status)
        return response

    async def get(self, path: str, params: Mapping[str, str]) -> JSON:
        response = await self._open(path, params, self._request_timeout)
        try:
            body = await response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise KubeApiError(f"GET {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            response.release()
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise KubeApiError(f"GET {path}: the answer is not JSON") from exc
        if not isinstance(doc, dict):
            raise KubeApiError(f"GET {path}: the answer is not a JSON object")
        return doc

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[JSON]:
        response = await self._open(path, params, self._watch_timeout)
        try:
            while True:
                try:
                    line = await response.content.readline()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    raise KubeApiError(f"watch {path}: {type(exc).__name__}: {exc}") from exc
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise KubeApiError(f"watch {path}: an event is not JSON") from exc
                if not isinstance(event, dict):
                    raise KubeApiError(f"watch {path}: an event is not a JSON object")
                yield event
        finally:
            response.close()

    async def close(self) -> None:
        await self._client.close()


def _read_namespace(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _kubeconfig_path(explicit: str | None) -> str:
    if explicit:
        return os.path.expanduser(explicit)
    env = os.environ.get("KUBECONFIG", "")
    first = env.split(os.pathsep)[0] if env else ""
    return os.path.expanduser(first or "~/.kube/config")


async def connect(
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    request_timeout_s: float = 10.0,
    watch_timeout_s: float = 300.0,
    environ: Mapping[str, str] | None = None,
    namespace_file: str = IN_CLUSTER_NAMESPACE_FILE,
) -> Connection:
    """In-cluster config when running in a pod and no kubeconfig is named, else the kubeconfig."""
    from kubernetes_asyncio import client as k8s_client
    from kubernetes_asyncio import config as k8s_config
    from kubernetes_asyncio.config.config_exception import ConfigException

    env = os.environ if environ is None else environ
    configuration: Any = k8s_client.Configuration()
    try:
        if kubeconfig is None and env.get("KUBERNETES_SERVICE_HOST"):
            load_incluster: Any = k8s_config.load_incluster_config
            load_incluster(client_configuration=configuration)
            source = "in-cluster"
            if namespace is None:
                namespace = _read_namespace(namespace_file)
        else:
            source = _kubeconfig_path(kubeconfig)
            loader: Any = await k8s_config.load_kube_config(
                config_file=source,
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
            if namespace is None:
                current: Any = loader.current_context
                ctx: Any = current["context"] if current is not None else None
                value = ctx.get("namespace") if ctx is not None else None
                namespace = value if isinstance(value, str) and value else None
    except (ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        raise KubeApiError(f"cannot load Kubernetes credentials: {exc}") from exc
    api_client: Any = k8s_client.ApiClient(configuration)
    api = AsyncioKubeApi(api_client, request_timeout_s, watch_timeout_s)
    return Connection(api=api, namespace=namespace or "default", source=source)
