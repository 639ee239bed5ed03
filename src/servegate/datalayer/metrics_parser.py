"""A Prometheus text parser that reads only what one engine's spec needs.

A vLLM page holds hundreds of lines (histograms, process and HTTP metrics) of
which a router needs about ten. Splitting the page into lines already costs more
than the budget (100 µs per page), so the parser never splits it: one regular
expression, compiled once per engine, starts with a newline plus the literal
prefix the needed family names share, which lets the regex engine skip through
the page at C speed and stop only at lines of those families. Only those lines
are parsed; `prometheus_client`'s parser is the reference the tests compare with.

No input raises: a line of a needed family that cannot be read is skipped and
counted in `ParseResult.malformed`; non-finite values (NaN, ±Inf) are ignored.
Values that are finite but impossible (a negative queue, KV usage of 5) are named
in `ParseResult.out_of_range` (see `servegate.pool.sanity`); the result's
metrics are clamped into range either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import isfinite as _isfinite

from mypy_extensions import mypyc_attr

from servegate.engines.spec import SIGNALS, Aggregation, EngineSpec, MetricSpec, Signal
from servegate.pool.endpoint import EndpointMetrics, LoraInfo
from servegate.pool.sanity import out_of_range, sane

Labels = dict[str, str]
Series = tuple[Labels, float]
Found = dict[str, list[Series]]

LORA_MAX = "max_lora"
LORA_RUNNING = "running_lora_adapters"
LORA_WAITING = "waiting_lora_adapters"

_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
# Possessive quantifiers (*+, ++) keep every pattern linear on hostile input.
_REST = re.compile(r"[ \t]*+(?:\{(.*)\}[ \t]*+)?([^ \t\r{}]++)(?:[ \t]++([^ \t\r]++))?[ \t\r]*+")
_PLAIN_LABELS = re.compile(f'(?:{_NAME}="[^"\\\\]*+",)*+(?:{_NAME}="[^"\\\\]*+",?)?')
_PLAIN_PAIR = re.compile(f'({_NAME})="([^"]*+)"')
_LABEL = re.compile(
    f'[ \\t]*+({_NAME})[ \\t]*+=[ \\t]*+"((?:[^"\\\\]++|\\\\.)*+)"[ \\t]*+(,?)', re.DOTALL
)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_LABEL_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class ParseResult:
    metrics: EndpointMetrics
    malformed: int
    """Lines of needed families that could not be read (skipped)."""
    samples: int
    """Lines of needed families that were read."""
    missing: tuple[str, ...]
    """Signals the engine publishes that this page did not provide."""
    out_of_range: tuple[str, ...] = ()
    """Signals whose values no engine can report (negative, absurdly large); the scraper
    rejects such a page. `metrics` holds them clamped into range."""


# A test subclasses it to fail on purpose (compiled by mypyc, native.txt).
@mypyc_attr(allow_interpreted_subclasses=True)
class MetricsParser:
    """Built once per engine spec; `parse` is the hot path."""

    __slots__ = ("_first", "_label_cache", "_lines", "_signals", "families", "prefixes", "spec")

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.families: tuple[str, ...] = spec.families()
        self.prefixes: tuple[str, ...] = self.families
        self._signals: tuple[tuple[str, Signal], ...] = tuple(
            (name, spec.signal(name)) for name in SIGNALS if spec.signal(name)
        )
        self._lines, self._first = _compile(self.families)
        self._label_cache: dict[str, Labels | None] = {}

    def scan(self, text: str) -> tuple[Found, int]:
        """Series of the needed families, name → [(labels, value)], and the malformed count."""
        found: Found = {}
        malformed = 0
        cache = self._label_cache
        if not self.families:
            return found, 0
        first = self._first.match(text) if text.startswith(self.prefixes) else None
        matches = self._lines.finditer(text)
        for match in (first, *matches) if first is not None else matches:
            series = _parse_rest(match.group(2), cache)
            if series is None:
                malformed += 1
                continue
            name = match.group(1)
            bucket = found.get(name)
            if bucket is None:
                found[name] = [series]
            else:
                bucket.append(series)
        return found, malformed

    def parse(self, text: str, now: float) -> ParseResult:
        found, malformed = self.scan(text)
        metrics = EndpointMetrics(scraped_at=now)
        missing: list[str] = []
        for signal, sources in self._signals:
            if signal == "lora":
                lora = _lora(sources, found)
                if lora is None:
                    missing.append(signal)
                metrics.lora = lora
                continue
            value = _first_value(sources, found)
            if value is None:
                missing.append(signal)
            elif signal == "block_size":
                metrics.block_size = _count(value)
            elif signal == "num_blocks":
                metrics.num_blocks = _count(value)
            else:
                setattr(metrics, signal, value)
        if self.spec.rank_label is not None:
            metrics.rank_load = _rank_load(self.spec, found)
        samples = sum(map(len, found.values()))
        bad = tuple(name for name in out_of_range(metrics) if name not in missing)
        return ParseResult(sane(metrics), malformed, samples, tuple(missing), bad)


def _compile(families: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """`\\n` + the names as a trie: the regex engine jumps to the shared literal prefix and
    rejects most other lines after one or two characters."""
    name = f"({_trie(sorted(set(families)))})(?![a-zA-Z0-9_:])"
    return re.compile(f"\\n{name}([^\\n]*)"), re.compile(f"{name}([^\\n]*)")


def _trie(words: list[str]) -> str:
    prefix = _common_prefix(words)
    rests = [word[len(prefix) :] for word in words]
    optional = "" in rests
    heads: dict[str, list[str]] = {}
    for rest in rests:
        if rest:
            heads.setdefault(rest[0], []).append(rest)
    branches = [_trie(group) for _, group in sorted(heads.items())]
    if not branches:
        return re.escape(prefix)
    body = branches[0] if len(branches) == 1 and not optional else f"(?:{'|'.join(branches)})"
    return re.escape(prefix) + (f"{body}?" if optional else body)


def _common_prefix(words: list[str]) -> str:
    first, last = min(words), max(words)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _parse_rest(rest: str, cache: dict[str, Labels | None]) -> Series | None:
    match = _REST.fullmatch(rest)
    if match is None:
        return None
    body, value_text, timestamp = match.groups()
    try:
        value = float(value_text)
        if timestamp is not None:
            float(timestamp)
    except ValueError:
        return None
    if body is None:
        return {}, value
    if body in cache:
        labels = cache[body]
    else:
        if len(cache) >= _LABEL_CACHE_SIZE:
            cache.clear()
        labels = cache[body] = parse_labels(body)
    return None if labels is None else (labels, value)


def parse_labels(body: str) -> Labels | None:
    """The text between `{` and `}`; None when it is not a valid label set."""
    if "\\" not in body and _PLAIN_LABELS.fullmatch(body):
        return dict(_PLAIN_PAIR.findall(body))
    labels: Labels = {}
    pos, end = 0, len(body)
    while pos < end:
        match = _LABEL.match(body, pos)
        if match is None:
            return labels if not body[pos:].strip() else None
        name, value, comma = match.groups()
        labels[name] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = match.end()
        if not comma and body[pos:].strip():
            return None
    return labels


def _unescape(match: re.Match[str]) -> str:
    char = match.group(1)
    return "\n" if char == "n" else char


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if _isfinite(value) else None


def _selected(source: MetricSpec, found: Found) -> list[Series]:
    for name in source.names:
        series = found.get(name)
        if not series:
            continue
        if source.labels:
            wanted = source.labels
            series = [s for s in series if all(s[0].get(k) == v for k, v in wanted)]
            if not series:
                continue
        return series
    return []


def _evaluate(source: MetricSpec, found: Found) -> float | None:
    series = _selected(source, found)
    if not series:
        return None
    label = source.label
    if label is None:
        values = [value for _, value in series if _isfinite(value)]
    else:
        values = [v for labels, _ in series if (v := _number(labels.get(label))) is not None]
    if not values:
        return None
    if len(values) == 1:
        result = values[0]
    elif source.aggregation is Aggregation.SUM:
        result = sum(values)
    elif source.aggregation is Aggregation.MEAN:
        result = sum(values) / len(values)
    else:
        result = max(values)
    if source.per is not None:
        divisor = _evaluate(source.per, found)
        if not divisor:
            return None
        result /= divisor
    return result if _isfinite(result) else None


def _rank_load(spec: EngineSpec, found: Found) -> dict[int, float] | None:
    """Waiting + running per data-parallel rank, when the page shows two ranks or more."""
    label = spec.rank_label
    assert label is not None
    load: dict[int, float] = {}
    for sources in (spec.waiting, spec.running):
        for source in sources:
            series = _selected(source, found)
            if not series:
                continue
            for labels, value in series:
                rank = _number(labels.get(label))
                if rank is None or not _isfinite(value) or rank != int(rank):
                    continue
                load[int(rank)] = load.get(int(rank), 0.0) + value
            break
    return load if len(load) > 1 else None


def _first_value(sources: Signal, found: Found) -> float | None:
    for source in sources:
        value = _evaluate(source, found)
        if value is not None:
            return value
    return None


def _lora(sources: Signal, found: Found) -> LoraInfo | None:
    for source in sources:
        series = [s for s in _selected(source, found) if _isfinite(s[1])]
        if not series:
            continue
        labels, _ = max(series, key=_value_of)
        max_lora = _number(labels.get(LORA_MAX))
        if max_lora is None or max_lora < 0:
            continue
        return LoraInfo(
            max_lora=int(max_lora),
            running=_adapters(labels.get(LORA_RUNNING)),
            waiting=_adapters(labels.get(LORA_WAITING)),
        )
    return None


def _value_of(series: Series) -> float:
    return series[1]


def _adapters(text: str | None) -> frozenset[str]:
    if not text:
        return frozenset()
    return frozenset(name for part in text.split(",") if (name := part.strip()))


def _count(value: float) -> int | None:
    return int(value) if value >= 1 else None
