"""The in-process latency predictor: per-endpoint TTFT and TPOT models learned online.

One `LatencyPredictor` per pool, owned by the pool's live state (it outlives picker
reloads) and handed to plugins as the shared service `latency-predictor`. The
scheduler only reads it (`predict`); the gateway writes it, outside the scheduling
call: `dispatched` when a request is sent (the endpoint's prompt backlog grows),
`learn_ttft` as soon as a stream's first byte shows its TTFT, `completed` when it ends
(the backlog shrinks and, for a stream that produced tokens, the TPOT it showed, and the
TTFT if not learned yet, are learned).

Features, all read from what the pool already has (`features`), shaped after how an
engine with continuous batching spends time (vLLM's scheduler, which the simulator
copies): a request's first token comes after the rest of the engine step under way,
then every step until its prompt is prefilled, each step costing a fixed overhead, a
cost per decoding sequence and a cost per prefilled token:

    TTFT ≈ residual step + steps × (overhead + per-sequence × decoding)
           + per-token × (backlog + uncached),   steps ≈ 1 + (backlog + uncached) / budget

which is linear in the features below once `decoding × (backlog + uncached)` is one
of them (the extra steps a long prefill queue costs every decoding sequence).

| TTFT feature | unit |
|---|---|
| 1 (intercept) | — |
| prefill ahead of the first token: this request's uncached prompt tokens (prompt × (1 − prefix match)) + the backlog | 1000 tokens |
| backlog: uncached prompt tokens this gateway sent there with no first token yet, each for the share of its predicted prefill still ahead (`EndpointModel.backlog`) | 1000 tokens |
| requests decoding there: in flight (this router and its peers) minus those prefilling | requests |
| decoding × (backlog + uncached): the per-step decode cost of the extra prefill steps | requests × 1000 tokens |
| requests this gateway sent there with no first token yet | requests |
| the engine's waiting requests (scraped) | requests |
| the engine's KV-cache usage (scraped) | fraction |
| LoRA adapter requested but not running there | 0/1 |

The backlog's tokens cost what this request's own do (they are prefilled in the
same steps), so they are in the prefill feature too, and the backlog feature, with a
prior of 0, only learns how their cost differs: a backlog seldom seen (a replica that
rarely prefills a long document) is costed at the per-token rate every prompt teaches.

TPOT uses the intercept, decoding requests, the prefill backlog with this request's
own prompt, the rate of uncached prompt tokens recently sent there (prefill that will
share the steps of this request's decode), waiting requests and KV usage.
Each endpoint has its own pair of models
(`OnlineRegression`), whose prior is the pool-wide pair's current fit, which
learns from every endpoint's observations; the pool-wide pair's prior is fixed
(`TTFT_PRIOR`, `TPOT_PRIOR`). An endpoint's prior is the pool's fit times its `Speed`
(how much slower than the pool's fit its latencies have been, measured on every
request it served), so a new endpoint starts from what the others taught, a slower
one is costed as slower at once, also for requests unlike those it has seen, and an
endpoint that differs otherwise moves away as its own data arrives. Before an endpoint
has taught any TTFT, a request of its still waiting past its predicted first token is
the only evidence of its speed (`cold_factor`).

Learning is capped per endpoint (`reserve`, `learn_per_s`): the gateway asks once per
stream, at its dispatch, whether to learn from it; below the cap every stream is
learned, above it an evenly spaced `learn_per_s` a second, the rest only releasing
their backlog (and paying for no first-token tracking or learning).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.latency.model import OnlineRegression

SERVICE_KEY = "latency-predictor"
"""`PluginContext.services` key of the pool's `LatencyPredictor`."""

TTFT_FEATURES = ("intercept", "prefill_ktokens", "backlog_ktokens", "decoding",
                 "decoding_x_prefill_ktokens", "prefilling", "waiting", "kv_usage",
                 "lora_miss")  # fmt: skip
TPOT_FEATURES = ("intercept", "decoding", "prefill_ktokens", "recent_ktokens_per_s", "waiting",
                 "kv_usage")  # fmt: skip

TTFT_PRIOR = (15.0, 40.0, 0.0, 2.0, 0.5, 5.0, 10.0, 0.0, 20.0)
"""Milliseconds per unit of each TTFT feature before any observation."""
TTFT_SCALE = (1.0, 0.2, 1.0, 4.0, 2.0, 1.0, 1.0, 0.3, 0.2)
"""Typical feature values: the prior counts as one observation of this size. The
per-token prior (40 ms per 1,000 tokens, a fast GPU's) counts as a 200-token prompt: the
prior is weighted like a typical observation, 1/y² of short ones, and at 0.5 it outweighed
the first long prompts of a slower engine (replayed over four recorded runs: mean TTFT
MAPE 25.4 → 25.2 %; one `slo` trace 15.6 → 14.7 %)."""
TTFT_TYPICAL_MS = 100.0
TPOT_PRIOR = (8.0, 0.3, 1.0, 1.0, 0.0, 0.0)
TPOT_SCALE = (1.0, 4.0, 1.0, 1.0, 1.0, 0.3)
TPOT_TYPICAL_MS = 10.0
MIN_MS = 0.1
"""Predictions are never below this (a linear fit can go negative far from its data)."""
ERROR_DECAY = 0.98
"""Weight of the past in the running mean absolute percentage error (≈ the last 50)."""
MIN_LEARNED_MS = 0.5
"""A TTFT or TPOT below this is not the engine's pace but a stream relayed in one burst
(its tokens buffered somewhere): not learned, not counted in the error. Observations
are weighted 1/y², so one such near-zero value would otherwise outweigh everything."""
REMAINING_FLOOR = 0.2
"""A prompt still waiting for its first token counts at least this share of its tokens in
the backlog, however long past its predicted first token it is (under-predicted work is
not done work)."""
SPEED_AFTER = 10.0
"""Pool-wide observations before endpoints' speeds are measured against the pool's fit
(before that the fit is still its prior, and every endpoint would look slow)."""
SPEED_CLIP = 2.0
"""One observation moves an endpoint's log speed by at most this (a stalled request)."""
RATE_WINDOW_S = 10.0
"""Time constant of the recent-prompt-tokens rate (the TPOT feature)."""
RATIO_WINDOW = 50
"""Recent actual / predicted ratios kept per endpoint and target: the measured error an
irreversible decision (shedding) is weighed against."""
LEARN_PER_S = 100.0
"""Default cap on the streams an endpoint's models learn from per second (`sample`)."""
LEARN_BURST_S = 1.0
"""`sample`'s bucket holds this many seconds of the cap: bursts under it are all learned."""


def _no_ratios() -> deque[float]:
    return deque(maxlen=RATIO_WINDOW)


@dataclass(slots=True)
class Accuracy:
    """Running error of one target on one endpoint."""

    observations: int = 0
    mape: float = 0.0
    """Exponentially weighted mean absolute percentage error, as a fraction."""
    abs_pct_sum: float = 0.0
    """Sum of every absolute percentage error (with `observations`: the plain MAPE)."""
    ratios: deque[float] = field(default_factory=_no_ratios)
    """The last `RATIO_WINDOW` actual / predicted ratios."""
    _ordered: list[float] | None = None
    """`ratios` sorted, built on first read after a change (the admitter reads it per
    candidate; a sheddable request is checked again every 20 ms while it waits)."""

    def add(self, predicted: float, actual: float) -> float:
        ape = abs(predicted - actual) / max(actual, MIN_MS)
        self.ratios.append(actual / max(predicted, MIN_MS))
        self._ordered = None
        self.abs_pct_sum += ape
        self.mape = (
            ape if self.observations == 0 else (ERROR_DECAY * self.mape + (1.0 - ERROR_DECAY) * ape)
        )
        self.observations += 1
        return ape

    def low_ratio(self, quantile: float) -> float:
        """The `quantile` of the recent actual / predicted ratios (1.0 with none): a
        prediction times this is what the endpoint beat that often lately."""
        ordered = self._ordered
        if ordered is None:
            ordered = self._ordered = sorted(self.ratios)
        if not ordered:
            return 1.0
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class FirstToken(Protocol):
    """Something that learns when a request's first token arrived (the access record)."""

    @property
    def ttft_ms(self) -> float | None: ...


@dataclass(slots=True)
class Speed:
    """How much slower than the pool-wide fit an endpoint is: the geometric mean of
    measured / pool-predicted latency over its observations (forgotten like the fits).

    An endpoint's prior is the pool-wide fit times this, and the pool-wide fit learns
    each observation divided by it (it describes an endpoint of speed 1), so a slower
    GPU is costed as slower for prompts unlike those it served (its per-token cost
    follows from its short requests too). The two settle together, over hundreds of
    observations: the first speeds are measured against a pool fit still mixing them."""

    n: float = 0.0
    log_ratio: float = 0.0

    def add(self, measured: float, pool_predicted: float, forgetting: float) -> None:
        r = math.log(max(measured, MIN_MS) / max(pool_predicted, MIN_MS))
        r = -SPEED_CLIP if r < -SPEED_CLIP else (SPEED_CLIP if r > SPEED_CLIP else r)
        self.n = forgetting * self.n + 1.0
        self.log_ratio += (r - self.log_ratio) / self.n

    @property
    def factor(self) -> float:
        return math.exp(self.log_ratio)


@dataclass(slots=True)
class EndpointModel:
    """One endpoint's models, prompt backlog and accuracy."""

    ttft: OnlineRegression
    tpot: OnlineRegression
    pending: dict[int, tuple[float, float, int, FirstToken | None]] = field(default_factory=dict)
    """Per dispatched request: when it was sent, when its prefill is expected done, its
    uncached tokens, and what tells when its first token arrived (then its prefill is
    done, whatever expected)."""
    dispatched: int = 0
    ttft_error: Accuracy = field(default_factory=Accuracy)
    tpot_error: Accuracy = field(default_factory=Accuracy)
    recent_tokens: float = 0.0
    """Uncached prompt tokens sent here, decayed with `RATE_WINDOW_S` as of `recent_at`."""
    recent_at: float = 0.0
    ttft_speed: Speed = field(default_factory=Speed)
    tpot_speed: Speed = field(default_factory=Speed)
    learn_budget: float = math.inf
    """Streams `reserve` may still let this endpoint learn from, as of `learn_budget_at`
    (full to start with: clipped to the bucket's size when first read)."""
    learn_budget_at: float = -math.inf
    sampled_out: int = 0
    """Streams not learned from because the endpoint was over the learning-rate cap
    (counted at their end, and only those that had something to teach)."""
    due: float = math.inf
    """No request here still waiting for its first token was predicted to have it
    before this (a lower bound, raised by every full pass): until then none is
    overdue, and `overdue` need not look (the cold factor asks it of every endpoint
    per prediction, which made a cold pool's predictions a pass over everything in
    flight)."""

    def backlog(self, now: float) -> int:
        """Uncached prompt tokens dispatched here whose prefill is not done by `now` (no
        first token yet when that is known, else not expected done yet), each counted
        for the share of its predicted prefill time still ahead (at least
        `REMAINING_FLOOR`): the work still ahead of a new request, not all that was sent."""
        return self.load(now)[0]

    def load(self, now: float) -> tuple[int, int]:
        """`backlog(now)` and how many requests it is made of (those still prefilling)."""
        total = 0.0
        count = 0
        for sent_at, done_at, tokens, first in self.pending.values():
            if first is not None:
                if first.ttft_ms is not None:
                    continue
            elif done_at <= now:
                continue
            count += 1
            if now <= sent_at or done_at <= sent_at:
                total += tokens
            else:
                left = (done_at - now) / (done_at - sent_at)
                total += tokens * (left if left > REMAINING_FLOOR else REMAINING_FLOOR)
        return int(total), count

    def scan(self, now: float) -> tuple[int, int, float]:
        """`load(now)` and `overdue(now)` in one pass over the pending requests."""
        total = 0.0
        count = 0
        worst = 1.0
        due = math.inf
        for sent_at, done_at, tokens, first in self.pending.values():
            if first is not None:
                if first.ttft_ms is not None:
                    continue
                if done_at < due:
                    due = done_at
                if done_at > sent_at:
                    ratio = (now - sent_at) / (done_at - sent_at)
                    if ratio > worst:
                        worst = ratio
            elif done_at <= now:
                continue
            count += 1
            if now <= sent_at or done_at <= sent_at:
                total += tokens
            else:
                left = (done_at - now) / (done_at - sent_at)
                total += tokens * (left if left > REMAINING_FLOOR else REMAINING_FLOOR)
        self.due = due
        return int(total), count, worst

    def overdue(self, now: float) -> float:
        """How far past its predicted first token the most overdue request still waiting
        for one is, as a multiple of that prediction (1.0 when none is): its TTFT is at
        least that many times what was predicted.

        Before `due` every such request's ratio is at most 1 (`now` ≤ its predicted
        end), so the answer is 1.0 without a pass."""
        if now <= self.due:
            return 1.0
        worst = 1.0
        due = math.inf
        for sent_at, done_at, _, first in self.pending.values():
            if first is None or first.ttft_ms is not None:
                continue
            if done_at < due:
                due = done_at
            if done_at <= sent_at:
                continue
            ratio = (now - sent_at) / (done_at - sent_at)
            if ratio > worst:
                worst = ratio
        self.due = due
        return worst

    def recent_rate(self, now: float) -> float:
        """Uncached prompt tokens per second sent here lately (thousands)."""
        if self.recent_tokens <= 0.0:
            return 0.0
        age = now - self.recent_at
        decay = math.exp(-age / RATE_WINDOW_S) if age > 0.0 else 1.0
        return self.recent_tokens * decay / RATE_WINDOW_S / 1000.0

    def sent(self, tokens: int, now: float) -> None:
        age = now - self.recent_at
        decay = math.exp(-age / RATE_WINDOW_S) if age > 0.0 else 1.0
        self.recent_tokens = self.recent_tokens * decay + tokens
        if now > self.recent_at:
            self.recent_at = now


class Features:
    """What a prediction was made from; the feature vectors are built from it when read
    (by learning, once per stream), not for every request dispatched."""

    __slots__ = ("backlog", "decoding", "kv_usage", "lora_miss", "prefill", "prefilling",
                 "rate", "uncached_tokens", "waiting")  # fmt: skip

    def __init__(
        self,
        uncached_tokens: int,
        prefill: float,
        backlog: float,
        decoding: float,
        prefilling: float,
        waiting: float,
        kv_usage: float,
        lora_miss: float,
        rate: float,
    ) -> None:
        self.uncached_tokens = uncached_tokens
        self.prefill = prefill
        """This request's uncached prompt plus the backlog (thousands of tokens)."""
        self.backlog = backlog
        self.decoding = decoding
        self.prefilling = prefilling
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.lora_miss = lora_miss
        self.rate = rate

    @property
    def ttft(self) -> tuple[float, ...]:
        """The TTFT feature vector (`TTFT_FEATURES`)."""
        decoding, prefill = self.decoding, self.prefill
        return (1.0, prefill, self.backlog, decoding, decoding * prefill, self.prefilling,
                self.waiting, self.kv_usage, self.lora_miss)  # fmt: skip

    @property
    def tpot(self) -> tuple[float, ...]:
        """The TPOT feature vector (`TPOT_FEATURES`)."""
        return (1.0, self.decoding, self.prefill, self.rate, self.waiting, self.kv_usage)


class Prediction:
    """Predicted engine-side latencies for one request on one endpoint, in milliseconds."""

    __slots__ = ("_inputs", "tpot_ms", "ttft_ms", "uncached_tokens")

    def __init__(
        self,
        ttft_ms: float,
        tpot_ms: float,
        uncached_tokens: int,
        inputs: tuple[float, float, float, float, float, float, float, float],
    ) -> None:
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.uncached_tokens = uncached_tokens
        self._inputs = inputs
        """`Features`' arguments after `uncached_tokens`, in order."""

    @property
    def features(self) -> Features:
        """What the prediction was made from (built when read: by learning, not by dispatch)."""
        return Features(self.uncached_tokens, *self._inputs)


class LatencyPredictor:
    """Per-endpoint online TTFT/TPOT models for one pool (see the module docstring)."""

    def __init__(
        self,
        forgetting: float = 0.995,
        prior_weight: float = 1.0,
        endpoint_prior_weight: float = 5.0,
        learn_per_s: float | None = LEARN_PER_S,
    ) -> None:
        self.forgetting = forgetting
        self.learn_per_s = learn_per_s or 0.0
        """Streams per second and endpoint `sample` lets through (0: every one)."""
        self.prior_weight = prior_weight
        """How many observations the fixed prior of the pool-wide models is worth."""
        self.endpoint_prior_weight = endpoint_prior_weight
        """How many observations the pool-wide fit is worth as an endpoint model's prior."""
        self.pool_ttft = OnlineRegression(
            TTFT_PRIOR, TTFT_SCALE, prior_weight, forgetting, TTFT_TYPICAL_MS
        )
        self.pool_tpot = OnlineRegression(
            TPOT_PRIOR, TPOT_SCALE, prior_weight, forgetting, TPOT_TYPICAL_MS
        )
        self.endpoints: dict[str, EndpointModel] = {}
        self._next_key = 0

    # -- reads (the scheduler) ---------------------------------------------------------
    def model(self, address: str) -> EndpointModel:
        """The endpoint's models, created from the pool-wide fit on first use."""
        model = self.endpoints.get(address)
        if model is None:
            weight, lam = self.endpoint_prior_weight, self.forgetting
            model = EndpointModel(
                OnlineRegression(self.pool_ttft.theta, TTFT_SCALE, weight, lam, TTFT_TYPICAL_MS),
                OnlineRegression(self.pool_tpot.theta, TPOT_SCALE, weight, lam, TPOT_TYPICAL_MS),
            )
            self.endpoints[address] = model
        return model

    def features(
        self,
        state: EndpointState,
        prompt_tokens: int,
        prefix_match: float,
        lora: str | None,
        now: float,
    ) -> Features:
        """The feature vectors of a request of `prompt_tokens` on `state` at `now`."""
        return self.predict(state, prompt_tokens, prefix_match, lora, now).features

    def predict(
        self,
        state: EndpointState,
        prompt_tokens: int,
        prefix_match: float,
        lora: str | None,
        now: float,
    ) -> Prediction:
        """Predicted TTFT and TPOT (ms) of the request on `state`, with the features they
        came from (what `dispatched` and `completed` need); `estimate` is the hot path.

        One pass over the endpoint's pending requests gives both the backlog and, while
        it has taught no TTFT, how overdue its first tokens are (`cold_factor`); the sums
        run in the order of the feature vectors, term by term.
        """
        uncached = int(prompt_tokens * (1.0 - min(1.0, max(0.0, prefix_match))))
        model = self.endpoints.get(state.endpoint.address)
        cold = model is None or model.ttft_error.observations == 0
        worst = 1.0
        if model is not None and model.pending:
            if cold and now > model.due:  # some first token may be overdue: in the same pass
                tokens, prefilling, worst = model.scan(now)
            else:
                tokens, prefilling = model.load(now)
            rate = model.recent_rate(now)
        else:
            tokens = prefilling = 0
            rate = 0.0 if model is None else model.recent_rate(now)
        backlog = tokens / 1000.0
        m = state.metrics
        in_flight = state.in_flight_requests
        decoding = float(in_flight - prefilling) if in_flight > prefilling else 0.0
        lora_miss = 0.0
        if lora is not None:
            info = m.lora
            lora_miss = 0.0 if info is not None and lora in info.running else 1.0
        prefill = uncached / 1000.0 + backlog
        waiting = m.waiting
        kv = m.kv_usage
        a = self.pool_ttft.theta
        b = self.pool_tpot.theta
        if model is not None:  # an endpoint without observations of its own: the pool's fit
            if model.ttft.effective_n > 0.0:
                a = model.ttft.theta
            if model.tpot.effective_n > 0.0:
                b = model.tpot.theta
        ttft = (
            a[0] + a[1] * prefill + a[2] * backlog + a[3] * decoding + a[4] * (decoding * prefill)
            + a[5] * prefilling + a[6] * waiting + a[7] * kv + a[8] * lora_miss
        )  # fmt: skip
        if cold:
            ttft *= self._cold_factor(model, worst, now)
        tpot = b[0] + b[1] * decoding + b[2] * prefill + b[3] * rate + b[4] * waiting + b[5] * kv
        return Prediction(
            ttft if ttft > MIN_MS else MIN_MS,
            tpot if tpot > MIN_MS else MIN_MS,
            uncached,
            (prefill, backlog, decoding, float(prefilling), waiting, kv, lora_miss, rate),
        )

    def estimate(
        self,
        state: EndpointState,
        prompt_tokens: int,
        prefix_match: float,
        lora: str | None,
        now: float,
    ) -> tuple[float, float]:
        """`predict`'s TTFT and TPOT (ms) without building the features: the scheduler's
        hot path, once per candidate per decision (the same arithmetic, inlined)."""
        if prefix_match <= 0.0:
            u = prompt_tokens / 1000.0
        elif prefix_match >= 1.0:
            u = 0.0
        else:
            u = int(prompt_tokens * (1.0 - prefix_match)) / 1000.0
        model = self.endpoints.get(state.endpoint.address)
        in_flight = state.in_flight_requests
        m = state.metrics
        waiting = m.waiting
        kv = m.kv_usage
        backlog = 0.0
        prefilling = 0
        rate = 0.0
        worst = 1.0
        if model is None:
            a = self.pool_ttft.theta
            b = self.pool_tpot.theta
            cold = True
        else:
            a = model.ttft.theta if model.ttft.effective_n > 0.0 else self.pool_ttft.theta
            b = model.tpot.theta if model.tpot.effective_n > 0.0 else self.pool_tpot.theta
            cold = model.ttft_error.observations == 0
            if model.pending:
                if cold and now > model.due:  # how overdue its first tokens are, in the same pass
                    tokens, prefilling, worst = model.scan(now)
                else:
                    tokens, prefilling = model.load(now)
                backlog = tokens / 1000.0
            if model.recent_tokens > 0.0:
                rate = model.recent_rate(now)
        decoding = in_flight - prefilling if in_flight > prefilling else 0
        prefill = u + backlog
        ttft = (
            a[0] + a[1] * prefill + a[2] * backlog + (a[3] + a[4] * prefill) * decoding
            + a[5] * prefilling + a[6] * waiting + a[7] * kv
        )  # fmt: skip
        if lora is not None:
            info = m.lora
            if info is None or lora not in info.running:
                ttft += a[8]
        if cold:
            ttft *= self._cold_factor(model, worst, now)
        tpot = b[0] + b[1] * decoding + b[2] * prefill + b[3] * rate + b[4] * waiting + b[5] * kv
        return (ttft if ttft > MIN_MS else MIN_MS, tpot if tpot > MIN_MS else MIN_MS)

    def cold_factor(self, model: EndpointModel | None, now: float) -> float:
        """While an endpoint has taught no TTFT, its requests still waiting past their
        predicted first token are the only evidence of its speed: predictions there are
        raised to match the most overdue (and, while the pool has learned nothing at all,
        the most overdue anywhere: the priors are a fast GPU's)."""
        return self._cold_factor(model, 1.0 if model is None else model.overdue(now), now)

    def _cold_factor(self, model: EndpointModel | None, worst: float, now: float) -> float:
        """`cold_factor` given `model.overdue(now)` (`worst`)."""
        if self.pool_ttft.effective_n <= 0.0:
            for other in self.endpoints.values():
                if other.pending and other is not model:
                    worst = max(worst, other.overdue(now))
        return worst

    # -- writes (the gateway, outside scheduling) ---------------------------------------
    def sample(self, address: str, now: float) -> bool:
        """Whether the endpoint's models should learn from a stream whose first
        observation is in at `now`, counting a refusal in `sampled_out`: `reserve`
        for a stream known to teach something (one sampled at its end)."""
        if self.reserve(address, now):
            return True
        self.endpoints[address].sampled_out += 1
        return False

    def reserve(self, address: str, now: float) -> bool:
        """Whether the endpoint's models should learn from a stream dispatched at `now`;
        asked once per stream, its answer holds for both of the stream's observations
        (TTFT and TPOT). A refusal is not counted here: only a stream that turns out to
        have something to teach is (`skipped`), and a stream let through that teaches
        nothing gives its place back (`unreserve`).

        A token bucket per endpoint, refilled at `learn_per_s` and holding
        `LEARN_BURST_S` of it (at least one stream): below the cap every stream is learned (the predictions
        are those of an uncapped predictor); above it, `learn_per_s` streams a second,
        spread evenly, and the rest only release their backlog. Learning costs four
        statistics updates and solves per stream; past a few hundred streams a second
        more of them add CPU, not accuracy, and the forgetting (per observation) would
        otherwise shrink the models' memory to a fraction of a second. `now` need not
        increase from call to call (requests may have waited in a queue): an earlier
        `now` refills nothing, and the bucket refills from the latest one seen.
        """
        rate = self.learn_per_s
        if rate <= 0.0:
            return True
        model = self.endpoints.get(address)
        if model is None:
            model = self.model(address)
        budget = model.learn_budget
        if now > model.learn_budget_at:
            budget += (now - model.learn_budget_at) * rate
            model.learn_budget_at = now
            full = rate * LEARN_BURST_S
            if full < 1.0:  # a cap under one a second still lets one stream through
                full = 1.0
            if budget > full:
                budget = full
        if budget >= 1.0:
            model.learn_budget = budget - 1.0
            return True
        model.learn_budget = budget
        return False

    def unreserve(self, address: str) -> None:
        """A stream `reserve` let through taught nothing (it failed, a fallback served it,
        it came in one burst): its place goes back to the bucket, so that such streams
        take none (as when streams were sampled at their first observation)."""
        rate = self.learn_per_s
        model = self.endpoints.get(address)
        if rate <= 0.0 or model is None:
            return
        full = rate * LEARN_BURST_S
        if full < 1.0:
            full = 1.0
        budget = model.learn_budget + 1.0
        model.learn_budget = budget if budget < full else full

    def skipped(self, address: str) -> None:
        """A stream `reserve` refused had something to teach: count it in `sampled_out`."""
        self.model(address).sampled_out += 1

    def release(self, address: str, key: int) -> None:
        """`completed` with nothing to learn: the request's backlog entry goes."""
        model = self.endpoints.get(address)
        if model is not None:
            model.pending.pop(key, None)

    def dispatched(
        self,
        address: str,
        prediction: Prediction,
        now: float,
        first_token: FirstToken | None = None,
    ) -> int:
        """A request predicted as `prediction` was sent at `now`; the key for `completed`.

        `first_token.ttft_ms` turning non-None ends the request's share of the backlog;
        without it the share ends at the predicted end of its prefill.
        """
        model = self.model(address)
        self._next_key += 1
        key = self._next_key
        done_at = now + prediction.ttft_ms / 1000.0
        tokens = prediction.uncached_tokens
        model.pending[key] = (now, done_at, tokens, first_token)
        if first_token is not None and done_at < model.due:
            model.due = done_at
        model.sent(tokens, now)
        model.dispatched += 1
        return key

    def learn_ttft(
        self,
        address: str,
        prediction: Prediction,
        ttft_ms: float,
        uncached_tokens: int | None = None,
    ) -> None:
        """Learn the TTFT a request showed, as soon as it is known (its first byte): a
        stream's end comes tokens later, and requests dispatched meanwhile should be
        predicted with it. Call once per request; `completed` then gets `ttft_ms=None`.

        `uncached_tokens`, when the engine reported its cached tokens, replaces the
        estimate in the learned features, so the fit learns what prefill cost, not how
        wrong the prefix estimate was.
        """
        if ttft_ms < MIN_LEARNED_MS:
            return
        model = self.model(address)
        model.ttft_error.add(prediction.ttft_ms, ttft_ms)
        x = prediction.features.ttft
        if uncached_tokens is not None:  # the engine's count; the step term follows it
            u = uncached_tokens / 1000.0
            x = (*x[:1], u + x[2], x[2], x[3], x[3] * (u + x[2]), *x[5:])
        speed = model.ttft_speed
        pool = self.pool_ttft
        predicted = None
        if pool.effective_n >= SPEED_AFTER:  # after the pool learned something
            predicted = pool.predict(x)
            speed.add(ttft_ms, predicted, self.forgetting)
        k = speed.factor
        pool.observe(x, ttft_ms / k, predicted=predicted)
        model.ttft.prior = _scaled(pool.theta, k)
        model.ttft.observe(x, ttft_ms)

    def completed(
        self,
        address: str,
        key: int,
        prediction: Prediction,
        ttft_ms: float | None,
        tpot_ms: float | None,
        uncached_tokens: int | None = None,
    ) -> None:
        """The request ended; learn the TTFT (unless `learn_ttft` already did: None) and
        TPOT it showed (None: not seen)."""
        model = self.model(address)
        model.pending.pop(key, None)
        if ttft_ms is not None and ttft_ms >= MIN_LEARNED_MS:
            self.learn_ttft(address, prediction, ttft_ms, uncached_tokens)
        if tpot_ms is not None and tpot_ms >= MIN_LEARNED_MS:
            x = prediction.features.tpot
            model.tpot_error.add(prediction.tpot_ms, tpot_ms)
            speed = model.tpot_speed
            pool = self.pool_tpot
            predicted = None
            if pool.effective_n >= SPEED_AFTER:
                predicted = pool.predict(x)
                speed.add(tpot_ms, predicted, self.forgetting)
            k = speed.factor
            pool.observe(x, tpot_ms / k, predicted=predicted)
            model.tpot.prior = _scaled(pool.theta, k)
            model.tpot.observe(x, tpot_ms)

    def forget(self, addresses: Iterable[str]) -> None:
        """Drop endpoints that left the pool."""
        for address in addresses:
            self.endpoints.pop(address, None)


def _scaled(theta: list[float], k: float) -> list[float]:
    """An endpoint's prior: the pool-wide fit times the endpoint's speed (set just before
    the endpoint's own fit is solved, the only time its prior is read)."""
    return [k * t for t in theta] if k != 1.0 else theta
