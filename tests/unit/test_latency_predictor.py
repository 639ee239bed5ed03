"""The per-endpoint latency predictor: features, cold start, learning, backlog, accuracy."""

from __future__ import annotations

import random

import pytest

from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState, LoraInfo
from servegate.scheduling.latency.predictor import (
    RATIO_WINDOW,
    REMAINING_FLOOR,
    TTFT_PRIOR,
    Accuracy,
    LatencyPredictor,
)


def state(address: str, in_flight: int = 0, waiting: float = 0.0, kv: float = 0.0) -> EndpointState:
    s = EndpointState(Endpoint(address=address, url=f"http://{address}"))
    s.in_flight_requests = in_flight
    s.metrics = EndpointMetrics(waiting=waiting, kv_usage=kv, scraped_at=1.0)
    return s


def test_features_read_the_prompt_match_load_and_lora() -> None:
    predictor = LatencyPredictor()
    s = state("a:1", in_flight=3, waiting=2, kv=0.4)
    f = predictor.features(s, 2000, 0.75, None, now=0.0)
    assert f.uncached_tokens == 500
    # nothing of this gateway's is prefilling there: all 3 in flight are decoding
    assert f.ttft == (1.0, 0.5, 0.0, 3.0, 1.5, 0.0, 2.0, 0.4, 0.0)
    assert f.tpot == (1.0, 3.0, 0.5, 0.0, 2.0, 0.4)
    assert predictor.features(s, 2000, 0.0, "ad", now=0.0).ttft[8] == 1.0  # no LoRA info
    s.metrics.lora = LoraInfo(max_lora=2, running=frozenset({"ad"}))
    assert predictor.features(s, 2000, 0.0, "ad", now=0.0).ttft[8] == 0.0
    assert predictor.features(s, 2000, 1.7, None, now=0.0).uncached_tokens == 0  # clamped


def test_requests_still_prefilling_are_not_counted_as_decoding() -> None:
    predictor = LatencyPredictor()
    s = state("a:1", in_flight=3)
    p = predictor.predict(s, 2000, 0.0, None, now=10.0)
    predictor.dispatched("a:1", p, now=10.0)
    f = predictor.features(s, 1000, 0.0, None, now=10.0)
    # 2 decoding; the extra-steps term covers the backlog and this request's prompt
    assert (f.ttft[2], f.ttft[3], f.ttft[4], f.ttft[5]) == pytest.approx((2.0, 2.0, 6.0, 1.0))
    assert f.tpot[1:4] == pytest.approx((2.0, 3.0, 0.2))  # 2000 tokens over a 10 s window
    later = predictor.features(s, 1000, 0.0, None, now=20.0).tpot[3]
    assert later == pytest.approx(0.2 * 2.718281828**-1, rel=1e-6)


def test_a_new_endpoint_predicts_from_the_prior_then_from_what_the_pool_learned() -> None:
    predictor = LatencyPredictor()
    fresh = predictor.predict(state("a:1"), 1000, 0.0, None, now=0.0)
    assert fresh.ttft_ms == pytest.approx(TTFT_PRIOR[0] + TTFT_PRIOR[1])
    # endpoint a teaches that everything takes 500 ms
    for _ in range(100):
        p = predictor.predict(state("a:1"), 1000, 0.0, None, now=0.0)
        key = predictor.dispatched("a:1", p, now=0.0)
        predictor.completed("a:1", key, p, 500.0, 20.0)
    # a replica never seen before starts from the pool's fit, not the prior
    cold = predictor.predict(state("b:1"), 1000, 0.0, None, now=0.0)
    assert cold.ttft_ms == pytest.approx(500.0, rel=0.05)
    assert cold.tpot_ms == pytest.approx(20.0, rel=0.05)


def test_endpoints_that_differ_learn_their_own_speed() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(5)
    for _ in range(600):
        address, per_k = rng.choice((("fast:1", 50.0), ("slow:1", 150.0)))
        tokens = rng.randint(100, 4000)
        p = predictor.predict(state(address), tokens, 0.0, None, now=0.0)
        key = predictor.dispatched(address, p, now=0.0)
        predictor.completed(address, key, p, 20.0 + per_k * tokens / 1000, None)
    fast = predictor.predict(state("fast:1"), 3000, 0.0, None, now=0.0).ttft_ms
    slow = predictor.predict(state("slow:1"), 3000, 0.0, None, now=0.0).ttft_ms
    assert fast == pytest.approx(170.0, rel=0.1)
    assert slow == pytest.approx(470.0, rel=0.1)
    assert predictor.endpoints["slow:1"].ttft_error.mape < 0.05


def test_backlog_counts_prompts_until_their_prefill_is_expected_done() -> None:
    predictor = LatencyPredictor()
    s = state("a:1")
    p = predictor.predict(s, 3000, 0.0, None, now=10.0)
    key = predictor.dispatched("a:1", p, now=10.0)
    done_at = 10.0 + p.ttft_ms / 1000.0
    assert predictor.features(s, 100, 0.0, None, now=10.0).ttft[2] == pytest.approx(3.0)
    assert predictor.features(s, 100, 0.0, None, now=done_at + 0.001).ttft[2] == 0.0
    p2 = predictor.predict(s, 1000, 0.0, None, now=10.0)
    key2 = predictor.dispatched("a:1", p2, now=10.0)
    predictor.completed("a:1", key, p, None, None)  # a failure: nothing learned, released
    assert predictor.features(s, 100, 0.0, None, now=10.0).ttft[2] == pytest.approx(1.0)
    assert predictor.pool_ttft.effective_n == 0.0
    predictor.completed("a:1", key2, p2, None, None)
    assert not predictor.endpoints["a:1"].pending


@pytest.mark.parametrize(
    ("elapsed", "backlog"),
    [
        (0.0, 3.0),  # just sent: all 3,000 tokens ahead
        (0.5, 1.5),  # half its predicted prefill time gone: half its tokens
        (0.9, 3.0 * REMAINING_FLOOR),  # 0.1 left, but never under the floor share
    ],
    ids=["sent", "half", "nearly-done"],
)
def test_backlog_counts_the_share_of_each_prefill_still_ahead(
    elapsed: float, backlog: float
) -> None:
    predictor = LatencyPredictor()
    s = state("a:1")
    p = predictor.predict(s, 3000, 0.0, None, now=10.0)
    predictor.dispatched("a:1", p, now=10.0)
    now = 10.0 + elapsed * p.ttft_ms / 1000.0
    f = predictor.features(s, 100, 0.0, None, now=now)
    assert f.ttft[2] == pytest.approx(backlog, rel=1e-3)
    assert f.ttft[1] == pytest.approx(0.1 + backlog, rel=1e-3)  # prefill: own + backlog


def test_a_backlog_is_costed_at_the_per_token_rate_own_prompts_taught() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(3)
    for _ in range(300):  # one request at a time: never a backlog
        tokens = rng.randint(50, 4000)
        p = predictor.predict(state("a:1"), tokens, 0.0, None, now=0.0)
        key = predictor.dispatched("a:1", p, now=0.0)
        predictor.completed("a:1", key, p, 20.0 + 500.0 * tokens / 1000, None)
    p = predictor.predict(state("a:1"), 3000, 0.0, None, now=100.0)
    predictor.dispatched("a:1", p, now=100.0)
    # a 100-token prompt right behind a 3,000-token one: 20 + 500 x 3.1 = 1570 ms
    behind = predictor.predict(state("a:1"), 100, 0.0, None, now=100.0).ttft_ms
    assert behind == pytest.approx(1570.0, rel=0.1)


def test_a_slower_endpoint_is_costed_as_slower_for_prompts_it_has_not_seen() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(4)
    for _ in range(400):
        if rng.random() < 0.5:  # the fast one serves short and long prompts
            address, tokens, slowdown = "fast:1", rng.randint(50, 4000), 1.0
        else:  # the slow one, three times slower, only short ones
            address, tokens, slowdown = "slow:1", rng.randint(50, 100), 3.0
        p = predictor.predict(state(address), tokens, 0.0, None, now=0.0)
        key = predictor.dispatched(address, p, now=0.0)
        predictor.completed(address, key, p, slowdown * (20.0 + 100.0 * tokens / 1000), None)
    # a 3,000-token prompt: 3 x (20 + 100 x 3) = 960 ms on the slow one, 320 on the fast;
    # the speeds are still settling after 400 requests (without them: 341 ms, 1.07x)
    assert predictor.endpoints["slow:1"].ttft_speed.factor > 1.4
    slow = predictor.predict(state("slow:1"), 3000, 0.0, None, now=0.0).ttft_ms
    fast = predictor.predict(state("fast:1"), 3000, 0.0, None, now=0.0).ttft_ms
    assert fast == pytest.approx(320.0, rel=0.1)
    assert slow > 1.4 * fast


def test_backlog_ends_at_the_first_token_when_the_gateway_sees_it() -> None:
    class Record:
        ttft_ms: float | None = None

    predictor = LatencyPredictor()
    s = state("a:1")
    p = predictor.predict(s, 3000, 0.0, None, now=10.0)
    record = Record()
    predictor.dispatched("a:1", p, now=10.0, first_token=record)
    late = 10.0 + p.ttft_ms / 1000.0 + 5.0  # long after the predicted end of prefill
    # still counted (at the floor share: under-predicted work is not done work)
    assert predictor.features(s, 100, 0.0, None, now=late).ttft[2] == pytest.approx(
        3.0 * REMAINING_FLOOR
    )
    record.ttft_ms = 42.0
    assert predictor.features(s, 100, 0.0, None, now=10.0).ttft[2] == 0.0


def test_the_engine_reported_cache_hit_replaces_the_estimate_when_learning() -> None:
    predictor = LatencyPredictor()
    # the router believes nothing is cached, the engine says 900 of 1000 tokens were
    for _ in range(200):
        p = predictor.predict(state("a:1"), 1000, 0.0, None, now=0.0)
        key = predictor.dispatched("a:1", p, now=0.0)
        predictor.completed("a:1", key, p, 10.0 + 100.0 * 0.1, None, uncached_tokens=100)
    theta = predictor.endpoints["a:1"].ttft.theta
    assert theta[0] + theta[1] * 0.1 == pytest.approx(20.0, rel=0.05)


def test_accuracy_and_forgetting() -> None:
    predictor = LatencyPredictor()
    p = predictor.predict(state("a:1"), 1000, 0.0, None, now=0.0)
    key = predictor.dispatched("a:1", p, now=0.0)
    predictor.completed("a:1", key, p, p.ttft_ms * 2, p.tpot_ms / 2)
    model = predictor.endpoints["a:1"]
    assert model.ttft_error.mape == pytest.approx(0.5)
    assert model.tpot_error.mape == pytest.approx(1.0)
    assert model.ttft_error.observations == 1
    predictor.forget(["a:1", "unknown:1"])
    assert "a:1" not in predictor.endpoints


def test_mape_on_noisy_synthetic_latencies_converges() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(9)
    errors = []
    for i in range(2000):
        address = f"r{i % 4}:1"
        s = state(address, in_flight=rng.randint(0, 12), waiting=rng.choice((0, 0, 1, 2)))
        tokens = rng.randint(50, 3000)
        match = rng.choice((0.0, 0.9))
        p = predictor.predict(s, tokens, match, None, now=float(i))
        key = predictor.dispatched(address, p, now=float(i))
        true = 30 + 80 * tokens * (1 - match) / 1000 + 6 * s.in_flight_requests
        true += 40 * s.metrics.waiting
        actual = true * rng.uniform(0.9, 1.1)
        if i >= 1000:
            errors.append(abs(p.ttft_ms - actual) / actual)
        predictor.completed(address, key, p, actual, None)
    assert sum(errors) / len(errors) < 0.08


def test_the_hot_path_estimate_equals_the_full_prediction() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(3)
    for i in range(300):  # teach it something, with requests in flight
        address = f"r{i % 3}:1"
        s = state(address, in_flight=rng.randint(0, 6), waiting=rng.randint(0, 3), kv=0.3)
        p = predictor.predict(s, rng.randint(10, 3000), rng.random(), None, now=float(i))
        key = predictor.dispatched(address, p, now=float(i))
        if rng.random() < 0.7:
            predictor.completed(address, key, p, rng.uniform(50, 900), rng.uniform(10, 60))
    for i in range(200):
        s = state(f"r{i % 4}:1", in_flight=rng.randint(0, 6), waiting=rng.randint(0, 3), kv=0.5)
        if i % 5 == 0:
            s.metrics.lora = LoraInfo(max_lora=2, running=frozenset({"a"}))
        args = (s, rng.randint(0, 4000), rng.choice((0.0, 1.0, 1.3, rng.random())),
                rng.choice((None, "a", "b")), 300.0 + rng.random() * 5)  # fmt: skip
        full = predictor.predict(*args)
        assert predictor.estimate(*args) == pytest.approx((full.ttft_ms, full.tpot_ms))


def test_a_stream_relayed_in_one_burst_teaches_nothing() -> None:
    predictor = LatencyPredictor()
    for _ in range(50):
        p = predictor.predict(state("a:1", in_flight=2), 500, 0.0, None, now=0.0)
        key = predictor.dispatched("a:1", p, now=0.0)
        predictor.completed("a:1", key, p, 200.0, 40.0)
    p = predictor.predict(state("a:1", in_flight=2), 500, 0.0, None, now=0.0)
    key = predictor.dispatched("a:1", p, now=0.0)
    predictor.completed("a:1", key, p, 200.0, 0.004)  # every token arrived at once
    model = predictor.endpoints["a:1"]
    assert model.tpot_error.observations == 50
    after = predictor.predict(state("a:1", in_flight=2), 500, 0.0, None, now=0.0)
    assert after.tpot_ms == pytest.approx(40.0, rel=0.05)


def test_low_ratio_is_a_quantile_of_the_latest_actual_over_predicted() -> None:
    acc = Accuracy()
    assert acc.low_ratio(0.1) == 1.0  # nothing measured: the point estimate
    for actual in range(1, 11):  # ratios 0.1 … 1.0
        acc.add(100.0, 10.0 * actual)
    assert acc.low_ratio(0.1) == pytest.approx(0.2)  # index int(0.1 · 10) = 1
    assert acc.low_ratio(0.0) == pytest.approx(0.1)
    assert acc.low_ratio(1.0) == pytest.approx(1.0)
    for _ in range(RATIO_WINDOW):  # only the latest RATIO_WINDOW count
        acc.add(100.0, 300.0)
    assert acc.low_ratio(0.1) == pytest.approx(3.0)


class _Record:
    ttft_ms: float | None = None


def test_while_nothing_is_learned_an_overdue_first_token_raises_every_prediction() -> None:
    predictor = LatencyPredictor()
    p = predictor.predict(state("a:1"), 1000, 0.0, None, now=0.0)
    record = _Record()
    predictor.dispatched("a:1", p, now=0.0, first_token=record)
    later = 5.0 * p.ttft_ms / 1000.0  # a:1's first token is 5× overdue
    b = predictor.predict(state("b:1"), 1000, 0.0, None, now=later)
    assert b.ttft_ms == pytest.approx(5.0 * (TTFT_PRIOR[0] + TTFT_PRIOR[1]))
    assert predictor.estimate(state("b:1"), 1000, 0.0, None, later)[0] == pytest.approx(b.ttft_ms)
    record.ttft_ms = 300.0
    predictor.learn_ttft("a:1", p, 300.0)  # once something is learned, the fit decides
    b = predictor.predict(state("b:1"), 1000, 0.0, None, now=later)
    assert b.ttft_ms == pytest.approx(predictor.pool_ttft.predict(b.features.ttft))


def test_an_overdue_first_token_raises_predictions_only_where_nothing_was_learned() -> None:
    predictor = LatencyPredictor()
    for i in range(30):  # a:1 teaches the pool
        p = predictor.predict(state("a:1"), 1000, 0.0, None, now=float(i))
        key = predictor.dispatched("a:1", p, now=float(i))
        predictor.completed("a:1", key, p, 200.0, 10.0)
    now = 100.0
    for address in ("a:1", "c:1"):  # each has a request 3× overdue
        p = predictor.predict(state(address), 1000, 0.0, None, now=now)
        predictor.dispatched(address, p, now=now, first_token=_Record())
    later = now + 3.0 * p.ttft_ms / 1000.0
    c = predictor.predict(state("c:1", in_flight=1), 500, 0.0, None, now=later)
    assert c.ttft_ms == pytest.approx(3.0 * predictor.pool_ttft.predict(c.features.ttft))
    a = predictor.predict(state("a:1", in_flight=1), 500, 0.0, None, now=later)
    assert a.ttft_ms == pytest.approx(predictor.endpoints["a:1"].ttft.predict(a.features.ttft))


class _First:
    def __init__(self, ttft_ms: float | None) -> None:
        self.ttft_ms = ttft_ms


def test_the_one_pass_scan_equals_the_backlog_and_overdue_passes() -> None:
    predictor = LatencyPredictor()
    model = predictor.model("a:1")
    rng = random.Random(5)
    for key in range(40):  # every kind of pending request: waiting, first token seen, none
        sent = rng.uniform(0.0, 10.0)
        done = sent + rng.choice([0.0, rng.uniform(0.01, 3.0)])
        first = rng.choice([None, _First(None), _First(12.0)])
        model.pending[key] = (sent, done, rng.randrange(1, 4000), first)
    for now in (0.0, 2.5, 5.0, 9.9, 14.0):
        assert model.scan(now) == (*model.load(now), model.overdue(now))


def _overdue_by_a_full_pass(
    pending: dict[int, tuple[float, float, int, _First | None]], now: float
) -> float:
    worst = 1.0
    for sent, done, _, first in pending.values():
        if first is not None and first.ttft_ms is None and done > sent:
            worst = max(worst, (now - sent) / (done - sent))
    return worst


def test_overdue_skips_its_pass_only_while_no_first_token_can_be_overdue() -> None:
    predictor = LatencyPredictor()
    rng = random.Random(11)
    model = predictor.model("a:1")
    firsts: dict[int, _First] = {}
    now = 0.0
    passes = 0
    for _ in range(3000):  # requests sent, first tokens seen, requests ended, time passing
        now += rng.expovariate(200.0)
        action = rng.random()
        if action < 0.4:
            first = _First(None)
            p = predictor.predict(state("a:1"), rng.randrange(1, 4000), 0.0, None, now)
            firsts[predictor.dispatched("a:1", p, now, first)] = first
        elif action < 0.7 and firsts:
            firsts[rng.choice(list(firsts))].ttft_ms = 1.0
        elif firsts:
            key = rng.choice(list(firsts))
            del firsts[key]
            predictor.completed("a:1", key, p, None, None)
        at = now + rng.choice([0.0, 0.01, 0.1, 1.0, 10.0])
        expected = _overdue_by_a_full_pass(model.pending, at)  # type: ignore[arg-type]
        passes += at > model.due
        assert model.overdue(at) == expected
        assert model.scan(at) == (*model.load(at), expected)
    assert 100 < passes < 2900  # both ways were taken


def test_a_prediction_builds_its_feature_vectors_from_what_it_read() -> None:
    predictor = LatencyPredictor()
    s = state("a:1", in_flight=3, waiting=2, kv=0.4)
    p = predictor.predict(s, 2000, 0.75, "ad", now=0.0)
    assert p.uncached_tokens == p.features.uncached_tokens == 500
    assert p.features.ttft == (1.0, 0.5, 0.0, 3.0, 1.5, 0.0, 2, 0.4, 1.0)
    assert p.features.tpot == (1.0, 3.0, 0.5, 0.0, 2, 0.4)
    # the sums run term by term in the vectors' order: the pool's fit over them, exactly
    ttft = sum(t * x for t, x in zip(predictor.pool_ttft.theta, p.features.ttft, strict=True))
    assert p.ttft_ms == ttft * predictor.cold_factor(None, 0.0)


def test_sample_lets_a_burst_of_one_second_of_the_cap_through_then_the_cap_evenly() -> None:
    predictor = LatencyPredictor(learn_per_s=10.0)
    # the bucket starts full: 10 streams (1 s of the cap) at once are all learned
    assert [predictor.sample("a:1", 5.0) for _ in range(11)] == [True] * 10 + [False]
    assert predictor.sample("b:1", 5.0)  # per endpoint
    # then 1,000 streams a second for 2 s: one per 0.1 s refill, 20 in all
    taken = [predictor.sample("a:1", 5.0 + k / 1000.0) for k in range(1, 2001)]
    assert sum(taken) == 20
    at = [k for k, t in enumerate(taken, 1) if t]
    assert all(99 <= b - a <= 101 for a, b in zip([0, *at], at, strict=False))  # evenly
    assert predictor.endpoints["a:1"].sampled_out == 1 + 1980
    # a quiet second refills the bucket to its size, not beyond it
    assert [predictor.sample("a:1", 20.0) for _ in range(11)] == [True] * 10 + [False]


@pytest.mark.parametrize("cap", [None, 0.0])
def test_without_a_cap_every_stream_is_sampled(cap: float | None) -> None:
    predictor = LatencyPredictor(learn_per_s=cap)
    assert all(predictor.sample("a:1", 1.0) for _ in range(10_000))
    assert "a:1" not in predictor.endpoints  # not even a model is made for it


def test_an_earlier_now_refills_nothing_and_loses_no_time() -> None:
    predictor = LatencyPredictor(learn_per_s=10.0)
    assert sum(predictor.sample("a:1", 5.0) for _ in range(10)) == 10
    assert not predictor.sample("a:1", 4.0)  # a request that arrived earlier: no refill
    assert not predictor.sample("a:1", 5.05)  # half a stream since 5.0
    assert predictor.sample("a:1", 5.11)  # one since 5.0: the earlier call cost no time


def test_a_cap_under_one_a_second_still_learns_one_stream_per_period() -> None:
    predictor = LatencyPredictor(learn_per_s=0.01)
    assert [predictor.sample("a:1", 1.0) for _ in range(3)] == [True, False, False]
    assert not predictor.sample("a:1", 99.0)
    assert predictor.sample("a:1", 101.5)  # 100 s after the first


def test_the_hot_path_estimate_of_a_cold_endpoint_reads_its_overdue_first_tokens() -> None:
    class Waiting:
        ttft_ms: float | None = None

    predictor = LatencyPredictor()
    s = state("a:1", in_flight=4)
    for i in range(4):  # four requests sent, no first token yet: the endpoint is cold
        p = predictor.predict(s, 1000 + 300 * i, 0.0, None, now=i * 0.01)
        predictor.dispatched("a:1", p, i * 0.01, Waiting())
    late = 5.0  # long past every predicted first token
    full = predictor.predict(s, 500, 0.0, None, now=late)
    assert predictor.cold_factor(predictor.endpoints["a:1"], late) > 10.0
    assert predictor.estimate(s, 500, 0.0, None, now=late) == pytest.approx(
        (full.ttft_ms, full.tpot_ms)
    )
