"""Prefill/decode disaggregation between two simulators, gateway-orchestrated (NIXL params)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from servegate.simulator.tokenizer import encode_chat
from servegate.testing.cluster import SimCluster

BASE: dict[str, Any] = {
    "model": "tiny",
    "num_blocks": 65,
    "block_size": 4,
    "max_model_len": 256,
    "speed": 50.0,
}


async def test_prefill_then_decode() -> None:
    messages = [{"role": "user", "content": "summarize the following document " * 6}]
    n = len(encode_chat(messages))
    overrides = [{"role": "prefill"}, {"role": "decode"}]
    async with (
        SimCluster(2, base=BASE, overrides=overrides) as cluster,
        aiohttp.ClientSession() as http,
    ):
        prefill, decode = cluster
        leg1 = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
        async with http.post(prefill.url + "/v1/chat/completions", json=leg1) as resp:
            first = await resp.json()
        params = first["kv_transfer_params"]
        # ceil(n / 4) blocks hold the prompt and the one generated token
        assert len(params["remote_block_ids"]) == -(-n // 4)
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.config.port)
        assert params["remote_engine_id"] == prefill.engine.engine_id

        leg2 = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": params,
        }
        async with http.post(decode.url + "/v1/chat/completions", json=leg2) as resp:
            events = (await resp.text()).split("\n\n")[:-1]
        usage = orjson.loads(events[-2].removeprefix("data: "))["usage"]
        # everything but the last prompt token arrived from the prefill server
        assert usage["prompt_tokens_details"] == {"cached_tokens": n - 1}
        assert usage["completion_tokens"] == 4
        stats = decode.engine.stats
        assert (stats.prefix_cache_hits, stats.cached_prompt_tokens) == (0, n - 1)
        # the decode server computed one prompt token, then decoded
        assert stats.iteration_tokens.sum == 1 + 3


async def test_prefill_params_need_do_remote_decode() -> None:
    async with (
        SimCluster(1, base={**BASE, "role": "prefill"}) as cluster,
        aiohttp.ClientSession() as http,
    ):
        body = {"prompt": "hello", "max_tokens": 1}
        async with http.post(cluster.urls[0] + "/v1/completions", json=body) as resp:
            assert (await resp.json())["kv_transfer_params"] is None
