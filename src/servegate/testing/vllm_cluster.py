"""Real vLLM servers on loopback, started and stopped the way a test fixture needs.

`VllmCluster` starts N `python -m vllm.entrypoints.openai.api_server` processes at
once (vLLM spends most of its ~40 s start-up importing, so starting them together
saves that time N-1 times), each with prefix caching, a small KV cache (so eviction
happens), LoRA slots, KV events on its own ZeroMQ endpoint and the dev endpoints
(`/reset_prefix_cache`). Each server runs in its own process group: stopping sends
SIGTERM to the whole group and SIGKILL to whatever is left, so the engine-core and
worker processes vLLM forks never outlive a test run. A server that dies while
starting raises `EngineStartError` with the tail of its log, never a skip.

Only the standard library is used here; the interpreter that runs vLLM is a setting.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

from servegate.testing.tinymodel import TinyModel

LOOPBACK = "127.0.0.1"
_NOISE = re.compile(r"launcher\.py:\d+\] Route: |\"GET /(health|metrics) HTTP")


class EngineStartError(RuntimeError):
    """A vLLM server could not be started or did not become healthy in time."""


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """How the servers run. Defaults follow shared/REAL_VLLM.md."""

    replicas: int = 2
    served_model_name: str = "tiny"
    block_size: int = 32
    """The CPU attention backend needs a multiple of 32."""
    num_blocks: int = 128
    """128 × 32 = 4096 tokens: small enough that a shared-prefix workload evicts."""
    max_model_len: int = 2048
    max_loras: int = 2
    max_lora_rank: int = 8
    adapters: tuple[str, ...] | None = None
    """Adapters registered with `--lora-modules` on every server; None = all of the model's."""
    kv_cache_space_gib: int = 1
    kv_transport: Literal["ipc", "tcp"] = "ipc"
    """`ipc://` sockets, or `tcp://*:P` binds that subscribers reach on 127.0.0.1:P."""
    pin_cores: bool = True
    """Bind server i's worker threads to core i mod cpu_count instead of all to core 0."""
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    python: str = field(default_factory=lambda: sys.executable)
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 on CPU, got {self.block_size}")
        if self.block_size * self.num_blocks < self.max_model_len:
            raise ValueError(
                f"num_blocks × block_size = {self.block_size * self.num_blocks} tokens must "
                f"cover max_model_len {self.max_model_len}; raise num_blocks"
            )


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def http_request(
    url: str,
    body: Any = None,
    *,
    method: str | None = None,
    timeout_s: float = 60.0,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP exchange: (status, headers with lower-case names, body). A JSON `body` is sent as JSON."""
    data = None
    all_headers = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, _lower(response.headers.items()), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, _lower(exc.headers.items()), exc.read()


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


class VllmServer:
    """One vLLM OpenAI server process (and the processes it forks), by process group."""

    def __init__(
        self,
        index: int,
        model: TinyModel,
        settings: ClusterSettings,
        workdir: Path,
        socket_dir: Path,
    ) -> None:
        self.index = index
        self.model = model
        self.settings = settings
        self.port = free_port()
        self.address = f"{LOOPBACK}:{self.port}"
        self.url = f"http://{self.address}"
        self.topic = f"kv@{self.address}@{settings.served_model_name}"
        if settings.kv_transport == "ipc":
            self.kv_bind = f"ipc://{socket_dir}/kv-{index}.sock"
            self.kv_connect = self.kv_bind
        else:
            kv_port = free_port()
            self.kv_bind = f"tcp://*:{kv_port}"
            self.kv_connect = f"tcp://{LOOPBACK}:{kv_port}"
        self.log_path = workdir / f"vllm-{index}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.last_start_s: float | None = None
        """Seconds from launch to a healthy /health on the latest start."""
        self._launched_at = 0.0
        self._log: IO[bytes] | None = None

    def __repr__(self) -> str:
        return f"VllmServer({self.index}, {self.url}, pid={self.pid})"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def adapters(self) -> dict[str, Path]:
        names = self.settings.adapters
        if names is None:
            return dict(self.model.adapters)
        return {name: self.model.adapters[name] for name in names}

    def command(self) -> list[str]:
        s = self.settings
        cmd = [
            s.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model.model_dir),
            "--served-model-name", s.served_model_name,
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--max-model-len", str(s.max_model_len),
            "--enable-prefix-caching",
            "--block-size", str(s.block_size),
            "--num-gpu-blocks-override", str(s.num_blocks),
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_bind,
                "topic": self.topic,
            }),
        ]  # fmt: skip
        adapters = self.adapters
        if adapters or s.max_loras:
            cmd += ["--enable-lora", "--max-loras", str(s.max_loras)]
            cmd += ["--max-lora-rank", str(s.max_lora_rank)]
        if adapters:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
        return [*cmd, *s.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONWARNINGS", None)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.settings.kv_cache_space_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        if self.settings.pin_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.index % (os.cpu_count() or 1))
        env.update(self.settings.extra_env)
        return env

    def start(self) -> None:
        """Launch the server; `wait_healthy` waits for it."""
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"=== start {self.starts + 1}: {' '.join(self.command())}\n".encode())
        self._log.flush()
        self._launched_at = time.monotonic()
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            status, _, _ = http_request(f"{self.url}/health", timeout_s=timeout_s)
        except OSError:
            return False
        return status == 200

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Seconds from launch until /health answered 200; raises if it dies or times out."""
        deadline = time.monotonic() + (timeout_s or self.settings.startup_timeout_s)
        while time.monotonic() < deadline:
            if self.process is None:
                raise EngineStartError(f"{self!r} was never started")
            code = self.process.poll()
            if code is not None:
                raise EngineStartError(
                    f"vLLM server {self.index} exited with code {code} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.last_start_s = time.monotonic() - self._launched_at
                return self.last_start_s
            time.sleep(0.5)
        raise EngineStartError(
            f"vLLM server {self.index} not healthy within "
            f"{timeout_s or self.settings.startup_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to whatever outlives `stop_timeout_s`."""
        self._signal_group(signal.SIGTERM, self.settings.stop_timeout_s)

    def kill(self) -> None:
        """SIGKILL to the whole group at once: what a crash looks like from outside."""
        self._signal_group(signal.SIGKILL, self.settings.stop_timeout_s)

    def _signal_group(self, sig: signal.Signals, timeout_s: float) -> None:
        process = self.process
        if process is None:
            return
        pgid = process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            process.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                deadline = time.monotonic() + timeout_s
            time.sleep(0.1)
        if self._log is not None:
            self._log.write(
                f"=== stopped with {sig.name}, exit code {process.returncode}\n".encode()
            )
            self._log.close()
            self._log = None

    def restart(self, timeout_s: float | None = None) -> float:
        self.stop()
        self.start()
        return self.wait_healthy(timeout_s)

    def log_tail(self, lines: int = 120) -> str:
        """The log's last lines, without vLLM's start-up list of routes and access lines."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [line for line in text.splitlines() if not _NOISE.search(line)]
        return "\n".join(kept[-lines:])

    def get(self, path: str, timeout_s: float = 30.0) -> bytes:
        status, _, body = http_request(f"{self.url}{path}", timeout_s=timeout_s)
        if status != 200:
            raise RuntimeError(f"GET {self.url}{path} answered {status}: {body[:500]!r}")
        return body

    def post(self, path: str, body: Any, timeout_s: float = 120.0) -> Any:
        status, _, raw = http_request(f"{self.url}{path}", body, timeout_s=timeout_s)
        if status != 200:
            raise RuntimeError(f"POST {self.url}{path} answered {status}: {raw[:500]!r}")
        return json.loads(raw) if raw else None

    def metrics_text(self) -> str:
        return self.get("/metrics").decode()

    def tokenize(self, prompt: str, model: str | None = None) -> list[int]:
        """The engine's own token ids for a completion prompt (special tokens included)."""
        doc = self.post("/tokenize", {"model": model or self.settings.served_model_name,
                                      "prompt": prompt})  # fmt: skip
        return [int(t) for t in doc["tokens"]]

    def reset_prefix_cache(self) -> None:
        status, _, raw = http_request(f"{self.url}/reset_prefix_cache", b"", method="POST")
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache on {self.url} answered {status}: {raw!r}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VllmCluster:
    """N real vLLM servers; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        model: TinyModel,
        settings: ClusterSettings | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.model = model
        self.settings = settings or ClusterSettings()
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="servegate-vllm-"))
        self._socket_dir = Path(tempfile.mkdtemp(prefix="sg-kv-"))
        self.servers: tuple[VllmServer, ...] = tuple(
            VllmServer(i, model, self.settings, self.workdir, self._socket_dir)
            for i in range(self.settings.replicas)
        )
        self.startup_s: float | None = None
        """Wall seconds from launching all servers until every one was healthy."""
        self._atexit_registered = False

    def __iter__(self) -> Iterator[VllmServer]:
        return iter(self.servers)

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, index: int) -> VllmServer:
        return self.servers[index]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> None:
        """Launch every server at once and wait until all are healthy, or stop them all."""
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        started = time.monotonic()
        try:
            for server in self.servers:
                server.start()
            for server in self.servers:
                remaining = self.settings.startup_timeout_s - (time.monotonic() - started)
                server.wait_healthy(max(remaining, 1.0))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def stop(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGTERM)
        for server in self.servers:
            server.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def logs(self, lines: int = 120) -> str:
        parts = []
        for server in self.servers:
            parts.append(
                f"----- vLLM server {server.index} ({server.url}, {server.log_path}) -----"
            )
            parts.append(server.log_tail(lines))
        return "\n".join(parts)

    def __enter__(self) -> VllmCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._own_workdir and exc is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
