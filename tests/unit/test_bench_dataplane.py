"""bench/dataplane.py's pure parts: wrk output, round order, medians, ratios, noise flags."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "dataplane.py"

WRK_OUTPUT = """\
Running 5s test @ http://127.0.0.1:40000
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    12.31ms    3.02ms  41.20ms   80.11%
    Req/Sec     5.21k   312.44     5.80k    72.00%
  Latency Distribution
     50%   11.90ms
     75%   13.40ms
     90%  850.00us
     99%    1.02s
  25934 requests in 5.00s, 21.37MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:   5186.21
Transfer/sec:      4.27MB
"""


@pytest.fixture(scope="module")
def dataplane() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dataplane_bench", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dataplane_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_parse_wrk_reads_counts_percentiles_and_errors(dataplane: ModuleType) -> None:
    result = dataplane.parse_wrk(WRK_OUTPUT)
    assert result.requests == 25934
    assert result.duration_s == pytest.approx(5.0)
    assert result.req_per_s == pytest.approx(5186.21)
    assert result.p50_ms == pytest.approx(11.90)
    assert result.p90_ms == pytest.approx(0.85)
    assert result.p99_ms == pytest.approx(1020.0)
    assert result.non_2xx == 4
    assert result.socket_errors == 3


def test_parse_wrk_refuses_other_output(dataplane: ModuleType) -> None:
    with pytest.raises(ValueError, match="not wrk output"):
        dataplane.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")
    with pytest.raises(ValueError, match="not a wrk duration"):
        dataplane.duration_ms("12 parsecs")


def test_rotated_changes_who_goes_first_every_round(dataplane: ModuleType) -> None:
    names = ["a", "b", "c"]
    orders = [dataplane.rotated(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["a", "c", "b"], ["c", "a", "b"]]
    assert {tuple(sorted(o)) for o in orders} == {("a", "b", "c")}
    assert len({o[0] for o in orders}) >= 2
    assert dataplane.rotated([], 3) == []


def test_spread(dataplane: ModuleType) -> None:
    assert dataplane.spread([100.0]) == 0.0
    assert dataplane.spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)


def _segment(
    dataplane: ModuleType,
    target: str,
    cpu_s: float,
    *,
    round_index: int = 0,
    requests: int = 10_000,
    load_cpu_s: float = 2.0,
    loadavg: float = 1.0,
    errors: int = 0,
) -> object:
    return dataplane.Segment(
        target=target,
        mode="json",
        connections=16,
        round_index=round_index,
        requests=requests,
        wall_s=5.0,
        target_cpu_s=cpu_s,
        load_cpu_s=load_cpu_s,
        req_per_s=requests / 5.0,
        p50_ms=1.0 + round_index,
        p99_ms=5.0,
        errors=errors,
        loadavg=loadavg,
    )


def test_summarise_takes_medians_and_ratios_against_both_peers(dataplane: ModuleType) -> None:
    segments = []
    for r, (ours, vllm, sglang) in enumerate([(3.0, 2.0, 0.6), (3.1, 1.9, 0.62), (2.9, 2.1, 0.61)]):
        segments += [
            _segment(dataplane, "servegate", ours, round_index=r),
            _segment(dataplane, "vllm-router", vllm, round_index=r),
            _segment(dataplane, "sglang-router", sglang, round_index=r),
        ]
    rows = {row.target: row for row in dataplane.summarise(segments, cores=2)}
    ours = rows["servegate"]
    assert ours.cpu_us == pytest.approx(300.0)  # median of 290, 300, 310
    assert ours.p50_ms == pytest.approx(2.0)
    assert ours.vs_vllm_router == pytest.approx(1.5)
    assert ours.vs_sglang_router == pytest.approx(300.0 / 61.0)
    assert rows["vllm-router"].vs_vllm_router == pytest.approx(1.0)
    assert all(row.flags == [] for row in rows.values())
    # order: servegate first, then the peers
    ordered = [row.target for row in dataplane.summarise(segments, cores=2)]
    assert ordered == ["servegate", "vllm-router", "sglang-router"]


def test_summarise_flags_noise(dataplane: ModuleType) -> None:
    segments = [
        _segment(dataplane, "servegate", 2.0, round_index=0),
        _segment(dataplane, "servegate", 3.0, round_index=1, load_cpu_s=4.8),
        _segment(dataplane, "servegate", 2.5, round_index=2, loadavg=9.0, errors=2),
    ]
    (row,) = dataplane.summarise(segments, cores=2)
    flags = "; ".join(row.flags)
    assert "rounds disagree (40%)" in flags
    assert "load core saturated (1/3)" in flags
    assert "machine load > 2 (1/3)" in flags
    assert "2 errors" in flags
    (short,) = dataplane.summarise(segments[:1], cores=2)
    assert short.flags == ["fewer than 3 rounds"]


def test_markdown_has_one_line_per_row(dataplane: ModuleType) -> None:
    rows = dataplane.summarise(
        [_segment(dataplane, "vllm-router", 2.0, round_index=r) for r in range(3)], cores=2
    )
    table = dataplane.markdown(rows).splitlines()
    assert len(table) == 3
    assert "| json | 16 | vllm-router | 200 | 1.00 | - |" in table[2]


def test_nginx_config_serves_every_port(dataplane: ModuleType, tmp_path: Path) -> None:
    text = dataplane.nginx_config(tmp_path, [8101, 8102], [8201])
    for port in (8101, 8102, 8201):
        assert f"listen 127.0.0.1:{port}" in text
    assert text.count("text/event-stream") == 2  # completions and chat on the SSE port
    whole, stream, _, _ = dataplane.canned()
    assert stream.count(b"data: ") == dataplane.SSE_CHUNKS + 1
    assert stream.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' in whole


@pytest.fixture(scope="module")
def profile() -> ModuleType:
    path = SCRIPT.parent / "dataplane_profile.py"
    spec = importlib.util.spec_from_file_location("dataplane_profile", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dataplane_profile"] = module
    spec.loader.exec_module(module)
    return module


ROOT = "run (servegate/gateway/server.py:134);_handle_request (aiohttp/web_protocol.py:577)"
HANDLER = ROOT + ";completions (servegate/gateway/app.py:479)"


def test_profile_folds_stacks_into_components_by_the_innermost_claimed_frame(
    profile: ModuleType,
) -> None:
    raw = [
        # orjson inside parse.py: parse, not the handler around it
        HANDLER + ";parse_request (servegate/gateway/parse.py:80);loads (orjson) 7",
        # a send under aiohttp's client, called from the proxy: the client
        HANDLER + ";forward (servegate/gateway/proxy.py:353);_request (aiohttp/client.py:900);"
        "write (aiohttp/http_writer.py:116);send 5",
        # the server writing the answer
        ROOT + ";finish_response (aiohttp/web_protocol.py:842);_writelines "
        "(aiohttp/http_writer.py:116) 3",
        HANDLER + ";write (servegate/gateway/logging.py:90) 2",
        HANDLER
        + ";finish (servegate/gateway/metrics.py:500);inc (prometheus_client/metrics.py:1) 2",
        HANDLER + ";_authorise (servegate/gateway/app.py:200) 1",
        HANDLER + ";admit (servegate/gateway/admission.py:120) 1",
        HANDLER + ";schedule (servegate/scheduling/scheduler.py:331) 4",
        HANDLER + ";parse_request (servegate/gateway/parse.py:80);gc_collect_main 2",
        "run (servegate/gateway/server.py:134);uv__io_poll;uv__read 6",
        "run (servegate/gateway/server.py:134);uv__io_poll;epoll_pwait 50",  # idle: dropped
        "not a sample line",
    ]
    counts = profile.fold(raw)
    assert counts == {
        "parse": 7,
        "aiohttp client": 5,
        "aiohttp server": 3,
        "access log": 2,
        "metrics": 2,
        "auth": 1,
        "admission + flow control": 1,
        "routing + scheduling": 4,
        "garbage collection": 2,
        # under the entry point only: the event loop waiting or switching
        "event loop (uvloop, epoll, task switching)": 6,
    }
    rows = profile.table(counts, cpu_us=330.0)
    assert rows[0][0] == "parse"
    assert sum(r[1] for r in rows) == 33
    assert sum(r[3] for r in rows) == pytest.approx(330.0)
