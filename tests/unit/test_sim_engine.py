"""The simulated scheduler, stepped by hand (`Engine.step_now`), no event loop sleeping."""

from __future__ import annotations

from typing import Any

import pytest

from servegate.simulator.config import parse_sim_config
from servegate.simulator.engine import Engine, RequestError, SimRequest
from servegate.simulator.tokenizer import EOS_ID, BuiltinTokenizer


def make_engine(**changes: Any) -> Engine:
    data: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_model_len": 128,
        "max_num_batched_tokens": 64,
        "costs": {"step_overhead_s": 0.01, "prefill_token_s": 0.001, "decode_seq_s": 0.002},
    }
    data.update(changes)
    return Engine(parse_sim_config(data), BuiltinTokenizer())


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run_until_done(engine: Engine, *reqs: SimRequest, limit: int = 500) -> int:
    steps = 0
    while not all(r.finished for r in reqs):
        engine.step_now()
        steps += 1
        assert steps < limit, "requests never finished"
    return steps


def test_continuous_batching_respects_max_num_seqs() -> None:
    engine = make_engine(max_num_seqs=2)
    reqs = [engine.submit(prompt(8, 1000 * i), request_id=f"r{i}", max_tokens=3) for i in range(3)]
    engine.step_now()
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    assert [r.num_output_tokens for r in reqs] == [1, 1, 0]
    run_until_done(engine, *reqs)
    assert engine.stats.finished["length"] == 3
    assert engine.stats.generation_tokens == 9


def test_chunked_prefill_splits_a_long_prompt() -> None:
    engine = make_engine(max_num_batched_tokens=8)
    req = engine.submit(prompt(20), request_id="r", max_tokens=2)
    computed = []
    for _ in range(3):
        engine.step_now()
        computed.append(req.num_computed)
    # budget 8 per step: 8, 16, 20 prompt tokens; the first token comes with the last chunk
    assert computed == [8, 16, 20]
    assert req.num_output_tokens == 1
    # that step cost: overhead 0.01 + 4 prefill tokens x 0.001
    assert engine.stats.last_step_s == pytest.approx(0.014)


def test_step_cost_formula() -> None:
    engine = make_engine(speed=2.0)
    a = engine.submit(prompt(10), request_id="a", max_tokens=5)
    engine.step_now()
    # prefill step: (0.01 + 10 x 0.001) / speed 2 = 0.01
    assert engine.stats.last_step_s == pytest.approx(0.01)
    engine.submit(prompt(6, 5000), request_id="b", max_tokens=5)
    engine.step_now()
    # a decodes, b prefills 6: (0.01 + 6 x 0.001 + 1 x 0.002) / 2 = 0.009
    assert engine.stats.last_step_s == pytest.approx(0.009)
    engine.slow_factor = 10.0
    engine.step_now()
    # two decodes: (0.01 + 2 x 0.002) / 2 x 10 = 0.07
    assert engine.stats.last_step_s == pytest.approx(0.07)
    assert a.num_output_tokens == 3


def test_prefix_hits_are_counted_in_tokens() -> None:
    engine = make_engine()
    first = engine.submit(prompt(22), request_id="a", max_tokens=2)
    run_until_done(engine, first)
    assert (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits) == (22, 0)
    second = engine.submit(prompt(22), request_id="b", max_tokens=2)
    engine.step_now()
    # 22 more queried tokens; hits: (22 - 1) // 4 = 5 blocks = 20 tokens
    assert (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits) == (44, 20)
    assert second.cached_tokens == 20
    # only the 2 uncached tokens were computed: 0.01 + 2 x 0.001
    assert engine.stats.last_step_s == pytest.approx(0.012)


def test_preemption_when_blocks_run_out() -> None:
    # 8 usable blocks of 4 tokens = 32 tokens; two requests grow to 14 + 12 tokens each
    engine = make_engine(num_blocks=9, max_model_len=32)
    a = engine.submit(prompt(14, 1000), request_id="a", max_tokens=12)
    b = engine.submit(prompt(14, 3000), request_id="b", max_tokens=12)
    run_until_done(engine, a, b)
    assert engine.stats.preemptions >= 1
    assert (a.num_output_tokens, b.num_output_tokens) == (12, 12)
    assert engine.kv.usage == 0.0


def test_lora_request_waits_for_a_slot() -> None:
    engine = make_engine(lora={"adapters": ["a1", "a2"], "max_loras": 1})
    assert engine.lora is not None
    a1, a2 = engine.lora.get("a1"), engine.lora.get("a2")
    r1 = engine.submit(prompt(6), request_id="r1", max_tokens=3, lora=a1)
    r2 = engine.submit(prompt(6, 3000), request_id="r2", max_tokens=3, lora=a2)
    base = engine.submit(prompt(6, 5000), request_id="b", max_tokens=3)
    engine.step_now()
    # one slot: a1 runs, a2 waits; the base-model request passes it
    assert [r.num_output_tokens for r in (r1, r2, base)] == [1, 0, 1]
    running, waiting = list(engine.stats.lora_info)[-1]
    assert (running, waiting) == ("a1", "a2")
    run_until_done(engine, r1)
    engine.step_now()
    assert r2.num_output_tokens == 1
    assert engine.lora.resident == [2]
    assert engine.lora.activations == 2


def test_lora_activation_adds_latency_once() -> None:
    engine = make_engine(lora={"adapters": ["a1"], "activation_latency_s": 0.5})
    assert engine.lora is not None
    req = engine.submit(prompt(4), request_id="r", max_tokens=3, lora=engine.lora.get("a1"))
    engine.step_now()
    # 0.01 + 4 x 0.001 + one adapter loaded x 0.5
    assert engine.stats.last_step_s == pytest.approx(0.514)
    engine.step_now()
    assert engine.stats.last_step_s == pytest.approx(0.012)
    assert req.num_output_tokens == 2


def test_abort_frees_blocks() -> None:
    engine = make_engine()
    req = engine.submit(prompt(9), request_id="r", max_tokens=50)
    engine.step_now()
    assert engine.kv.usage > 0
    engine.abort(req)
    assert req.finish_reason == "abort"
    assert (engine.num_running, engine.kv.usage) == (0, 0.0)
    assert engine.stats.finished["abort"] == 1


@pytest.mark.parametrize(
    ("stop", "include", "expected_text", "reason"),
    [
        pytest.param(("fox",), False, " the quick brown ", "fox", id="stop-excluded"),
        pytest.param(("fox",), True, " the quick brown fox", "fox", id="stop-included"),
        pytest.param(
            ("zebra",), False, " the quick brown fox the quick", None, id="no-match-length"
        ),
    ],
)
def test_stop_strings(
    stop: tuple[str, ...], include: bool, expected_text: str, reason: str | None
) -> None:
    engine = make_engine(output={"mode": "echo"})
    tok = engine.tokenizer
    ids = tok.encode(" the quick brown fox")
    assert len(ids) == 6  # " the", " quick", " br", "own", " fo", "x": echo cycles them
    req = engine.submit(ids, request_id="r", max_tokens=8, stop=stop, include_stop=include)
    run_until_done(engine, req)
    assert req.text == expected_text
    assert req.stop_reason == reason
    assert req.finish_reason == ("stop" if reason else "length")


def test_eos_ends_with_stop_unless_ignored() -> None:
    engine = make_engine(output={"eos_probability": 0.5})
    req = engine.submit(prompt(5), request_id="r", max_tokens=100)
    run_until_done(engine, req)
    assert req.finish_reason == "stop"
    assert req.output_ids[-1] == EOS_ID
    ignored = engine.submit(prompt(5), request_id="i", max_tokens=20, ignore_eos=True)
    run_until_done(engine, ignored)
    assert (ignored.finish_reason, ignored.num_output_tokens) == ("length", 20)


def test_outputs_are_deterministic_per_prompt() -> None:
    texts = []
    for _ in range(2):
        engine = make_engine(seed=3)
        req = engine.submit(prompt(7), request_id="r", max_tokens=6)
        run_until_done(engine, req)
        texts.append(req.text)
    assert texts[0] == texts[1]
    assert len(texts[0].split()) == 6


def test_prefill_role_returns_transfer_params() -> None:
    engine = make_engine(role="prefill", host="10.0.0.1", port=8100)
    req = engine.submit(
        prompt(10),
        request_id="p",
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    blocks_during = None
    while not req.finished:
        engine.step_now()
        blocks_during = blocks_during or req.seq.block_ids
    assert req.kv_transfer_params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3],  # 10 tokens + 1 generated fit in ceil(10/4) = 3 blocks
        "remote_engine_id": "sim-model@10.0.0.1:8100",
        "remote_request_id": "p",
        "remote_host": "10.0.0.1",
        "remote_port": 8100,
        "tp_size": 1,
    }


def test_decode_role_skips_transferred_prefill() -> None:
    engine = make_engine(role="decode", max_num_batched_tokens=4)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9]}
    req = engine.submit(prompt(12), request_id="d", max_tokens=3, kv_transfer_params=params)
    engine.step_now()
    # 3 remote blocks cover all 12 tokens; the last one is computed here: 0.01 + 1 x 0.001
    assert req.cached_tokens == 11
    assert req.num_output_tokens == 1
    assert engine.stats.last_step_s == pytest.approx(0.011)
    assert engine.stats.prefix_cache_hits == 0


def test_roles_ignore_the_other_sides_params() -> None:
    decode = make_engine(role="decode")
    req = decode.submit(
        prompt(8), request_id="x", max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    run_until_done(decode, req)
    assert req.kv_transfer_params is None
    prefill = make_engine(role="prefill")
    req = prefill.submit(
        prompt(8),
        request_id="y",
        max_tokens=1,
        kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [1, 2]},
    )
    prefill.step_now()
    assert req.cached_tokens == 0


@pytest.mark.parametrize(
    ("n", "max_tokens", "param"),
    [
        pytest.param(128, None, "input_tokens", id="prompt-at-max-model-len"),
        pytest.param(100, 29, "max_tokens", id="prompt-plus-max-tokens-too-long"),  # 100 + 29 > 128
        pytest.param(0, None, "prompt", id="empty-prompt"),
    ],
)
def test_validation(n: int, max_tokens: int | None, param: str) -> None:
    engine = make_engine()
    with pytest.raises(RequestError) as info:
        engine.submit(prompt(n), request_id="r", max_tokens=max_tokens)
    assert (info.value.status, info.value.param) == (400, param)


def test_default_max_tokens_fills_the_context() -> None:
    engine = make_engine()
    req = engine.submit(prompt(100), request_id="r")
    assert req.max_tokens == 28  # 128 - 100
