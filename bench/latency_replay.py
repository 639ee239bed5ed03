"""Record what the latency predictor saw in a bench run; replay it offline (not a test).

    .venv/bin/python bench/latency_slo.py --policy slo --trace /tmp/slo.jsonl   # record
    .venv/bin/python bench/latency_replay.py /tmp/slo.jsonl                      # replay

A simulator run takes minutes and its figures move with the machine's load; a replay
takes a second and is deterministic, so model variants (a feature, a prior, when a TTFT
is learned) can be compared on the very same requests. The trace holds, per request the
gateway dispatched: when (monotonic seconds), where, the endpoint's state the predictor
read (in flight, waiting, KV usage, the router's uncached-token estimate), when its first
byte was relayed and when it ended, and what the gateway learned from it. The replay
drives the current `LatencyPredictor` through its public calls in event order on a
virtual clock — `predict` and `dispatched` at each dispatch, the first token turning
visible at its time, `learn_ttft` there (as the gateway does), `completed` at the end —
and reports the TTFT and TPOT MAPE the bench would have reported (each prediction made at
dispatch, before its own TTFT is known), over the whole run and its later half.

Each stream is sampled as the gateway does it (`LatencyPredictor.reserve`, once per
stream at its dispatch, on the recorded clock; its place given back if it taught
nothing; `sample` at its first observation with a checkout from before that), where the
predictor has the learning cap. The routing decisions are the recorded ones: a replay measures prediction error on the
endpoints the requests went to, not what a different predictor would have chosen.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from servegate.scheduling.latency.predictor import MIN_LEARNED_MS, LatencyPredictor, Prediction


class _Recorder:
    """Wraps `LatencyPredictor`'s write calls to append one JSON line per request."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.open: dict[tuple[int, int], dict[str, Any]] = {}
        self.inputs: dict[int, dict[str, Any]] = {}
        """What `predict` read, by `id(prediction)` (until `dispatched`)."""
        self.learned: dict[int, float] = {}
        """TTFTs learnt at the first byte, by `id(prediction)` (alive until `completed`)."""

    def install(self) -> None:
        predict = LatencyPredictor.predict
        dispatched = LatencyPredictor.dispatched
        completed = LatencyPredictor.completed
        learn_ttft = LatencyPredictor.learn_ttft
        recorder = self

        def on_learn_ttft(
            self: LatencyPredictor, address: str, prediction: Prediction, ttft_ms: float,
            uncached_tokens: int | None = None,
        ) -> None:  # fmt: skip
            recorder.learned[id(prediction)] = ttft_ms
            learn_ttft(self, address, prediction, ttft_ms, uncached_tokens)

        def on_predict(
            self: LatencyPredictor, state: Any, prompt_tokens: int, prefix_match: float,
            lora: str | None, now: float,
        ) -> Prediction:  # fmt: skip
            prediction = predict(self, state, prompt_tokens, prefix_match, lora, now)
            m = state.metrics
            recorder.inputs[id(prediction)] = {
                "in_flight": state.in_flight_requests, "waiting": m.waiting,
                "kv_usage": m.kv_usage, "prompt_tokens": prompt_tokens,
                "prefix_match": prefix_match, "lora": lora,
            }  # fmt: skip
            return prediction

        def on_dispatched(
            self: LatencyPredictor, address: str, prediction: Prediction, now: float,
            first_token: Any = None,
        ) -> int:  # fmt: skip
            key = dispatched(self, address, prediction, now, first_token)
            recorder.open[id(self), key] = {
                "predictor": id(self), "endpoint": address, "t": now,
                **recorder.inputs.pop(id(prediction), {}),
                "uncached_est": prediction.features.uncached_tokens,
                "pred_ttft_ms": prediction.ttft_ms, "pred_tpot_ms": prediction.tpot_ms,
                "_first": first_token,
            }  # fmt: skip
            return key

        def on_completed(
            self: LatencyPredictor, address: str, key: int, prediction: Prediction,
            ttft_ms: float | None, tpot_ms: float | None, uncached_tokens: int | None = None,
        ) -> None:  # fmt: skip
            row = recorder.open.pop((id(self), key), None)
            if row is not None:
                first = row.pop("_first")
                t_first = None
                dispatched_ms = getattr(first, "dispatched_ms", None)
                first_ms = getattr(first, "ttft_ms", None)
                if first_ms is not None and dispatched_ms is not None:
                    t_first = row["t"] + (first_ms - dispatched_ms) / 1000.0
                learned = recorder.learned.pop(id(prediction), None)
                row.update(
                    t_first=t_first, t_done=time.monotonic(), uncached=uncached_tokens,
                    ttft_ms=ttft_ms if ttft_ms is not None else learned, tpot_ms=tpot_ms,
                )  # fmt: skip
                recorder.out.write(json.dumps(row) + "\n")
                recorder.out.flush()
            completed(self, address, key, prediction, ttft_ms, tpot_ms, uncached_tokens)
            recorder.learned.pop(id(prediction), None)  # `completed` learns through it too

        LatencyPredictor.predict = on_predict  # type: ignore[method-assign]
        LatencyPredictor.dispatched = on_dispatched  # type: ignore[method-assign]
        LatencyPredictor.completed = on_completed  # type: ignore[method-assign]
        LatencyPredictor.learn_ttft = on_learn_ttft  # type: ignore[method-assign]


def record_to(path: str) -> None:
    """Trace every request any `LatencyPredictor` in this process sees to `path`."""
    _Recorder(open(path, "w")).install()  # noqa: SIM115 - open for the whole run


# -- replay ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Metrics:
    waiting: float
    kv_usage: float
    lora: None = None
    """Not recorded: a LoRA request replays as a miss."""


@dataclass(slots=True)
class _Endpoint:
    address: str


@dataclass(slots=True)
class _State:
    """The fields of `EndpointState` the predictor reads."""

    endpoint: _Endpoint
    in_flight_requests: int
    metrics: _Metrics

    @property
    def address(self) -> str:
        return self.endpoint.address


@dataclass(slots=True)
class _FirstToken:
    ttft_ms: float | None = None


@dataclass(slots=True)
class Replayed:
    """Errors of one predictor's replay, in dispatch order."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    pred_ttft: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    all_ttft_ms: list[float] = field(default_factory=list)
    """Every prediction, learned from or not (to compare two predictors request by request)."""
    all_tpot_ms: list[float] = field(default_factory=list)

    @staticmethod
    def _mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    def summary(self) -> tuple[float, float, float, int]:
        """TTFT MAPE (whole run, later half), TPOT MAPE, and how many TTFTs."""
        later = self.ttft[len(self.ttft) // 2 :]
        return self._mean(self.ttft), self._mean(later), self._mean(self.tpot), len(self.ttft)


def load(path: str) -> dict[int, list[dict[str, Any]]]:
    """The trace's rows per predictor (one per policy's gateway), in dispatch order."""
    runs: dict[int, list[dict[str, Any]]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "t" not in row:
                raise SystemExit(f"{path}: not a trace of this tool (re-record it)")
            runs.setdefault(row["predictor"], []).append(row)
    for rows in runs.values():
        rows.sort(key=lambda r: r["t"])
    return runs


def _events(rows: list[dict[str, Any]]) -> Iterator[tuple[float, int, int]]:
    """(time, kind, row) in time order; kind 0 first token, 1 end, 2 dispatch (so that at
    equal times what ended before a dispatch is seen by it)."""
    events = []
    for i, r in enumerate(rows):
        events.append((r["t"], 2, i))
        if r["t_first"] is not None:
            events.append((r["t_first"], 0, i))
        events.append((r["t_done"], 1, i))
    events.sort()
    return iter(events)


def replay(
    rows: list[dict[str, Any]], predictor: LatencyPredictor, at_first_byte: bool = True
) -> Replayed:
    """Drive `predictor` through one recorded run (see the module docstring);
    `at_first_byte=False` learns each TTFT at the stream's end instead."""
    out = Replayed()
    firsts = [_FirstToken() for _ in rows]
    keys = [0] * len(rows)
    preds: list[Prediction | None] = [None] * len(rows)
    learned = [False] * len(rows)
    sampled: list[bool | None] = [None] * len(rows)
    taught = [False] * len(rows)
    learn_ttft = getattr(predictor, "learn_ttft", None) if at_first_byte else None
    reserve = getattr(predictor, "reserve", None)  # sampled at dispatch, as the gateway does
    sample = None if reserve is not None else getattr(predictor, "sample", None)
    for t, kind, i in _events(rows):
        r = rows[i]
        address = r["endpoint"]
        if kind == 2:
            state = _State(
                _Endpoint(address), int(r["in_flight"]), _Metrics(r["waiting"], r["kv_usage"])
            )
            if "prompt_tokens" in r:
                tokens, match, lora = r["prompt_tokens"], r["prefix_match"], r["lora"]
            else:  # recorded before the inputs were: the estimate is what they gave
                tokens, match, lora = r["uncached_est"], 0.0, None
            p = predictor.predict(state, tokens, match, lora, t)  # type: ignore[arg-type]
            preds[i] = p
            keys[i] = predictor.dispatched(address, p, t, firsts[i])
            if reserve is not None:
                sampled[i] = reserve(address, t)
            continue
        p = preds[i]
        assert p is not None
        ttft = r["ttft_ms"]
        if kind == 0:
            firsts[i].ttft_ms = (r["t_first"] - r["t"]) * 1000.0
            if learn_ttft is not None and ttft is not None:
                if ttft >= MIN_LEARNED_MS:
                    if sample is not None:  # a checkout that samples at the first observation
                        sampled[i] = sample(address, t)
                    if sampled[i] is not False:
                        learn_ttft(address, p, ttft)
                        taught[i] = True
                learned[i] = True
            continue
        tpot = r["tpot_ms"]
        if learned[i]:
            ttft = None
        teaches = (ttft is not None and ttft >= MIN_LEARNED_MS) or (
            tpot is not None and tpot >= MIN_LEARNED_MS
        )
        if reserve is not None:
            if sampled[i] is False:
                if teaches:
                    predictor.skipped(address)
                ttft = tpot = None
            elif not teaches and not taught[i]:
                predictor.unreserve(address)
        elif sample is not None and teaches:
            if sampled[i] is None:
                sampled[i] = sample(address, t)
            if not sampled[i]:
                ttft = tpot = None
        predictor.completed(address, keys[i], p, ttft, tpot, r["uncached"])
    for r, p in zip(rows, preds, strict=True):  # in dispatch order, as the bench reports
        assert p is not None
        out.all_ttft_ms.append(p.ttft_ms)
        out.all_tpot_ms.append(p.tpot_ms)
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        if ttft is not None and ttft >= MIN_LEARNED_MS:
            out.ttft.append(abs(p.ttft_ms - ttft) / ttft)
            out.pred_ttft.append(p.ttft_ms)
            out.ttft_ms.append(ttft)
        if tpot is not None and tpot >= MIN_LEARNED_MS:
            out.tpot.append(abs(p.tpot_ms - tpot) / tpot)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", nargs="+")
    p.add_argument("--windows", type=int, default=0, help="also TTFT MAPE per window of N")
    p.add_argument(
        "--learn-at-end", action="store_true", help="learn TTFTs at the stream's end (as before)"
    )
    p.add_argument(
        "--learn-per-s",
        type=float,
        help="the predictor's learning-rate cap (default: its own; 0: every stream)",
    )
    p.add_argument("--digits", type=int, default=1, help="decimals of the MAPE percentages")
    p.add_argument("--dump", help="write every prediction (TTFT, TPOT) here, one JSON line each")
    p.add_argument(
        "--against",
        help="a --dump of another predictor (e.g. another checkout's src on PYTHONPATH): "
        "print the largest relative difference of each trace's predictions from it",
    )
    args = p.parse_args()
    dump = open(args.dump, "w") if args.dump else None  # noqa: SIM115 - closed below
    against = _load_dump(args.against) if args.against else None
    pct = f".{args.digits}%"
    print("| trace | predictor | TTFT MAPE all (later half) | TPOT MAPE | n | recorded |")
    print("|---|---|---|---|---|---|")
    for path in args.trace:
        for run, (pid, rows) in enumerate(load(path).items()):
            predictor = (
                LatencyPredictor()
                if args.learn_per_s is None
                else LatencyPredictor(learn_per_s=args.learn_per_s)
            )
            result = replay(rows, predictor, not args.learn_at_end)
            ttft, later, tpot, n = result.summary()
            recorded = [
                abs(r["pred_ttft_ms"] - r["ttft_ms"]) / r["ttft_ms"]
                for r in rows
                if r["ttft_ms"] is not None and r["ttft_ms"] >= MIN_LEARNED_MS
            ]
            rec = sum(recorded) / len(recorded) if recorded else float("nan")
            print(
                f"| {path} | {pid} | {ttft:{pct}} ({later:{pct}}) | {tpot:{pct}} | {n} | {rec:{pct}} |"
            )
            predicted = list(zip(result.all_ttft_ms, result.all_tpot_ms, strict=True))
            if dump is not None:
                for i, (a, b) in enumerate(predicted):
                    dump.write(
                        json.dumps({"trace": path, "run": run, "i": i, "ttft": a, "tpot": b})
                    )
                    dump.write("\n")
            if against is not None:
                other = against.get((path, run))
                if other is None or len(other) != len(predicted):
                    print(f"  against: {path} run {run} not in {args.against}")
                else:
                    worst = max(
                        abs(x - y) / max(abs(y), 1e-300)
                        for mine, theirs in zip(predicted, other, strict=True)
                        for x, y in zip(mine, theirs, strict=True)
                    )
                    same = sum(
                        mine == theirs for mine, theirs in zip(predicted, other, strict=True)
                    )
                    print(
                        f"  against: largest relative difference {worst:.2e}; "
                        f"{same} of {len(predicted)} predictions bit-identical"
                    )
            if args.windows:
                w = args.windows
                cells = [
                    f"{sum(result.ttft[k : k + w]) / len(result.ttft[k : k + w]):.0%}"
                    for k in range(0, len(result.ttft), w)
                ]
                print("  windows:", " ".join(cells))
    if dump is not None:
        dump.close()


def _load_dump(path: str) -> dict[tuple[str, int], list[tuple[float, float]]]:
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.setdefault((row["trace"], row["run"]), []).append((row["ttft"], row["tpot"]))
    return out


if __name__ == "__main__":
    main()
