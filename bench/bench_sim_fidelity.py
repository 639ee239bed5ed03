"""Does the simulator's prefix cache follow real vLLM's? One request sequence, hit by hit.

    .venv-engine/bin/python bench/bench_sim_fidelity.py [--requests 40] [--seed 0]
                                                       [--real-url http://127.0.0.1:8000]

Starts one real vLLM server with the engine tier's tiny model and flags (block size
32, 128 blocks, prefix caching), unless `--real-url` names a running one, and one
simulator (`python -m servegate.simulator`) with the same geometry and the model's
own HuggingFace tokenizer folder. First every prompt (and a few chat conversations)
goes to `/tokenize` on both: the token ids must be identical. Then both get the same
sequential shared-prefix requests (`workload`): prefix groups of uneven popularity,
new questions, exact repeats and extended conversations, more distinct content
than the 127 usable blocks hold. After each request the deltas of
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` are read on
each server. The table shows them per request next to what an unbounded cache
would have hit, then the totals and the verdict against `Tolerance`.

tests/engine/test_sim_fidelity.py runs the same comparison on the engine tier's
server (`make test-engine`); docs/simulator.md records the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from servegate.datalayer.metrics_parser import MetricsParser
from servegate.engines import builtin_engines
from servegate.testing.tinymodel import TinyModel, build_tiny_model
from servegate.testing.vllm_cluster import (
    LOOPBACK,
    ClusterSettings,
    VllmCluster,
    free_port,
    http_request,
)

MODEL = "tiny"
BLOCK = 32
NUM_BLOCKS = 128
MAX_MODEL_LEN = 2048
WORDS = (
    "the", "of", "to", "in", "router", "cache", "block", "token", "prefix", "replica",
    "engine", "request", "queue", "model", "server", "gateway", "picker", "score", "load",
    "adapter", "stream", "alpha", "beta", "gamma", "delta", "north", "south", "river",
    "mountain", "city", "garden", "window", "paper", "music", "number", "letter", "story",
)  # fmt: skip
"""Words of the tiny model's training corpus: one token each for its BPE tokenizer."""
CHATS = (
    [{"role": "user", "content": "hello router"}],
    [
        {"role": "system", "content": "the cache of the gateway"},
        {"role": "user", "content": "alpha beta gamma"},
        {"role": "assistant", "content": "delta"},
        {"role": "user", "content": "north south"},
    ],
)
_PARSER = MetricsParser(builtin_engines()["vllm"])


@dataclass(frozen=True, slots=True)
class Probe:
    index: int
    group: str
    kind: str
    """`new` (group prefix + a new question), `repeat` (an earlier prompt again) or
    `extend` (the group's latest prompt plus a new turn)."""
    prompt: str
    max_tokens: int


def workload(seed: int = 1, requests: int = 40, groups: int = 8) -> list[Probe]:
    """Sequential shared-prefix requests; group g is chosen with weight 1/(g+1), so the
    popular prefixes stay cached while the rare ones and old questions are evicted."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prefixes = [f"fidelity {seed} group {g} {words(rng.randint(250, 600))}" for g in range(groups)]
    weights = [1 / (g + 1) for g in range(groups)]
    probes: list[Probe] = []
    latest: dict[int, str] = {}
    for i in range(requests):
        roll = rng.random()
        if probes and roll < 0.12:
            kind, earlier = "repeat", rng.choice(probes)
            group, text = int(earlier.group[1:]), earlier.prompt
        elif latest and roll < 0.3:
            kind, group = "extend", rng.choice(sorted(latest))
            text = f"{latest[group]} turn {i} {words(rng.randint(30, 150))}"
            if len(text.split()) > 1700:
                kind, text = "new", f"{prefixes[group]} question {i} {words(rng.randint(20, 250))}"
        else:
            kind, group = "new", rng.choices(range(groups), weights)[0]
            text = f"{prefixes[group]} question {i} {words(rng.randint(20, 250))}"
        latest[group] = text
        probes.append(Probe(i, f"g{group}", kind, text, rng.choice((1, 16, 48))))
    return probes


def unbounded_hits(prompts: Sequence[Sequence[int]], block: int = BLOCK) -> list[int]:
    """Hit tokens per prompt if no block were ever evicted: the longest run of leading
    full blocks seen in an earlier prompt, never including the last token."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for tokens in prompts:
        hit = 0
        while (hit + 1) * block <= len(tokens) - 1 and tuple(tokens[: (hit + 1) * block]) in seen:
            hit += 1
        out.append(hit * block)
        seen.update(tuple(tokens[: k * block]) for k in range(1, len(tokens) // block + 1))
    return out


@dataclass(frozen=True, slots=True)
class Observed:
    queries: int
    hits: int
    prompt_tokens: int
    """`usage.prompt_tokens` of the answer."""


class Target:
    """A vLLM-compatible server (real or simulated) seen only through its HTTP API."""

    def __init__(self, name: str, url: str, model: str = MODEL) -> None:
        self.name = name
        self.url = url
        self.model = model

    def post(self, path: str, body: Any, timeout_s: float = 120.0) -> Any:
        status, _, raw = http_request(f"{self.url}{path}", body, timeout_s=timeout_s)
        if status != 200:
            raise RuntimeError(f"{self.name}: POST {path} answered {status}: {raw[:300]!r}")
        return json.loads(raw)

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        return [int(t) for t in self.post("/tokenize", {"model": self.model, **body})["tokens"]]

    def state(self) -> tuple[int, int, int]:
        """(prefix-cache queries, hits, requests running or waiting) from `/metrics`."""
        status, _, raw = http_request(f"{self.url}/metrics", timeout_s=60)
        if status != 200:
            raise RuntimeError(f"{self.name}: GET /metrics answered {status}")
        m = _PARSER.parse(raw.decode(), now=time.time()).metrics
        if m.prefix_cache_queries is None or m.prefix_cache_hits is None:
            raise RuntimeError(f"{self.name}: /metrics has no prefix-cache counters")
        return int(m.prefix_cache_queries), int(m.prefix_cache_hits), int(m.running + m.waiting)

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the prefix cache once nothing holds a block (vLLM refuses until then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, _, raw = http_request(f"{self.url}/reset_prefix_cache", b"", method="POST")
            done = status == 200 and json.loads(raw or b"{}").get("success", True) is not False
            if done:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: prefix cache not reset: {status} {raw[:200]!r}")
            time.sleep(0.5)

    def complete(self, probe: Probe, expected_tokens: int, timeout_s: float = 30.0) -> Observed:
        """Send one request, then wait until its prefix lookup shows in the counters
        (vLLM's counters follow the engine's stats, not the response)."""
        queries, hits, _ = self.state()
        body = {
            "model": self.model,
            "prompt": probe.prompt,
            "max_tokens": probe.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        answer = self.post("/v1/completions", body)
        deadline = time.monotonic() + timeout_s
        while True:
            now_queries, now_hits, _ = self.state()
            if now_queries >= queries + expected_tokens:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: request {probe.index} counted {now_queries - queries} "
                    f"prefix-cache queries, expected {expected_tokens}"
                )
            time.sleep(0.05)
        return Observed(now_queries - queries, now_hits - hits, answer["usage"]["prompt_tokens"])

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state()[2]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: requests still in flight after {timeout_s} s")
            time.sleep(0.2)

    def run(self, probes: Sequence[Probe], tokens: Sequence[Sequence[int]]) -> list[Observed]:
        """The sequence from an empty prefix cache, one request at a time."""
        self.wait_idle()
        self.reset_prefix_cache()
        return [self.complete(p, len(t)) for p, t in zip(probes, tokens, strict=True)]


def same_tokens(
    real: Target, sim: Target, probes: Sequence[Probe]
) -> tuple[list[list[int]], list[str]]:
    """The real server's ids for every prompt, and every way the simulator's differ
    (prompts and the chat conversations in `CHATS`)."""
    tokens, mismatches = [], []
    for probe in probes:
        ids = real.tokenize({"prompt": probe.prompt})
        if sim.tokenize({"prompt": probe.prompt}) != ids:
            mismatches.append(f"prompt {probe.index}")
        tokens.append(ids)
    for i, messages in enumerate(CHATS):
        if real.tokenize({"messages": messages}) != sim.tokenize({"messages": messages}):
            mismatches.append(f"chat {i}")
    return tokens, mismatches


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How closely the simulator must follow real vLLM."""

    total_rel: float = 0.02
    """|sim total hits - real total hits| <= total_rel x real total hits."""
    per_request_tokens: int = BLOCK
    """A request agrees when its hit counts differ by at most this many tokens (one block)..."""
    per_request_share: float = 0.95
    """...and at least this share of the requests must agree."""


@dataclass(frozen=True, slots=True)
class Row:
    probe: Probe
    prompt_tokens: int
    unbounded: int
    real: Observed
    sim: Observed

    @property
    def diff(self) -> int:
        return self.sim.hits - self.real.hits


@dataclass(frozen=True, slots=True)
class Comparison:
    rows: tuple[Row, ...]

    @property
    def real_hits(self) -> int:
        return sum(r.real.hits for r in self.rows)

    @property
    def sim_hits(self) -> int:
        return sum(r.sim.hits for r in self.rows)

    @property
    def unbounded_hits(self) -> int:
        return sum(r.unbounded for r in self.rows)

    @property
    def queries(self) -> int:
        return sum(r.prompt_tokens for r in self.rows)

    def agreeing(self, tolerance: Tolerance) -> int:
        return sum(abs(r.diff) <= tolerance.per_request_tokens for r in self.rows)

    def exact(self) -> int:
        return sum(r.diff == 0 for r in self.rows)

    def failures(self, tolerance: Tolerance) -> list[str]:
        """What breaks the tolerance or makes the comparison meaningless; empty = pass."""
        out = []
        for r in self.rows:
            for name, seen in (("real", r.real), ("sim", r.sim)):
                if (seen.queries, seen.prompt_tokens) != (r.prompt_tokens, r.prompt_tokens):
                    out.append(
                        f"request {r.probe.index}: {name} counted {seen.queries} queries and "
                        f"{seen.prompt_tokens} prompt tokens for a {r.prompt_tokens}-token prompt"
                    )
        if abs(self.sim_hits - self.real_hits) > tolerance.total_rel * self.real_hits:
            out.append(
                f"total hits: simulator {self.sim_hits}, vLLM {self.real_hits} "
                f"(more than {tolerance.total_rel:.0%} apart)"
            )
        need = tolerance.per_request_share * len(self.rows)
        if self.agreeing(tolerance) < need:
            out.append(
                f"{self.agreeing(tolerance)} of {len(self.rows)} requests within "
                f"{tolerance.per_request_tokens} tokens, need {need:.0f}"
            )
        return out


def compare(
    probes: Sequence[Probe],
    tokens: Sequence[Sequence[int]],
    real: Sequence[Observed],
    sim: Sequence[Observed],
) -> Comparison:
    bound = unbounded_hits(tokens)
    rows = zip(probes, tokens, bound, real, sim, strict=True)
    return Comparison(tuple(Row(p, len(t), u, r, s) for p, t, u, r, s in rows))


def format_table(comparison: Comparison, tolerance: Tolerance) -> str:
    lines = [
        f"{'#':>3} {'group':>5} {'kind':>6} {'prompt':>6} {'out':>3} "
        f"{'unbounded':>9} {'vLLM':>5} {'sim':>5} {'diff':>5}"
    ]
    for r in comparison.rows:
        p = r.probe
        lines.append(
            f"{p.index:>3} {p.group:>5} {p.kind:>6} {r.prompt_tokens:>6} {p.max_tokens:>3} "
            f"{r.unbounded:>9} {r.real.hits:>5} {r.sim.hits:>5} {r.diff:>+5}"
        )
    c = comparison
    lines += [
        f"requests {len(c.rows)}, prompt tokens {c.queries} (= prefix-cache queries on both)",
        f"hit tokens: vLLM {c.real_hits}, simulator {c.sim_hits}, unbounded cache "
        f"{c.unbounded_hits} (eviction cost vLLM {c.unbounded_hits - c.real_hits})",
        f"requests with equal hits {c.exact()} / {len(c.rows)}, within one block "
        f"{c.agreeing(tolerance)} / {len(c.rows)}",
    ]
    failures = c.failures(tolerance)
    lines.append("verdict: " + ("within tolerance" if not failures else "; ".join(failures)))
    return "\n".join(lines)


def sim_config(model: TinyModel, port: int) -> dict[str, Any]:
    """The simulator with the real server's geometry and tokenizer."""
    return {
        "model": MODEL,
        "host": LOOPBACK,
        "port": port,
        "block_size": BLOCK,
        "num_blocks": NUM_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": True,
        "tokenizer": {"path": str(model.model_dir)},
        "speed": 20.0,
    }


@contextlib.contextmanager
def simulator(model: TinyModel, workdir: Path, timeout_s: float = 60.0) -> Iterator[Target]:
    """`python -m servegate.simulator` as a child process, always stopped on exit."""
    port = free_port()
    config = workdir / "sim-fidelity.yaml"
    config.write_text(yaml.safe_dump(sim_config(model, port)))
    log_path = workdir / "sim-fidelity.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servegate.simulator", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    target = Target("simulator", f"http://{LOOPBACK}:{port}")
    try:
        _wait(lambda: _healthy(target.url), proc, timeout_s, log_path)
        yield target
    finally:
        _stop(proc)


def _healthy(url: str) -> bool:
    try:
        return http_request(f"{url}/health", timeout_s=2)[0] == 200
    except OSError:
        return False


def _wait(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"simulator did not start; log {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def measure(real: Target, sim: Target, probes: Sequence[Probe]) -> tuple[Comparison, list[str]]:
    """Tokens checked on both, then the sequence on the real server, then on the simulator."""
    tokens, mismatches = same_tokens(real, sim, probes)
    for ids, probe in zip(tokens, probes, strict=True):
        if len(ids) + probe.max_tokens > MAX_MODEL_LEN:
            raise ValueError(f"request {probe.index} does not fit max_model_len {MAX_MODEL_LEN}")
    real_seen = real.run(probes, tokens)
    sim_seen = sim.run(probes, tokens)
    return compare(probes, tokens, real_seen, sim_seen), mismatches


@contextlib.contextmanager
def real_server(url: str | None, model: TinyModel, workdir: Path) -> Iterator[Target]:
    if url is not None:
        yield Target("vLLM", url.rstrip("/"))
        return
    settings = ClusterSettings(replicas=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    with VllmCluster(model, settings, workdir) as cluster:
        print(f"vLLM healthy after {cluster.startup_s:.1f} s at {cluster[0].url}", flush=True)
        yield Target("vLLM", cluster[0].url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--real-url", help="a running vLLM server of the tiny model")
    args = parser.parse_args()
    probes = workload(args.seed, args.requests, args.groups)
    model = build_tiny_model()
    tolerance = Tolerance()
    with tempfile.TemporaryDirectory(prefix="sg-fidelity-") as tmp:
        workdir = Path(tmp)
        started = time.monotonic()
        with real_server(args.real_url, model, workdir) as real, simulator(model, workdir) as sim:
            comparison, mismatches = measure(real, sim, probes)
        elapsed = time.monotonic() - started
    if mismatches:
        print("token ids differ between vLLM and the simulator for: " + ", ".join(mismatches))
    print(format_table(comparison, tolerance))
    print(f"wall time {elapsed:.1f} s (servers included)")
    return 1 if mismatches or comparison.failures(tolerance) else 0


if __name__ == "__main__":
    raise SystemExit(main())
