"""The engine's state under each persona's metric names (PROTOCOLS.md section 1).

One collector per persona reads the engine when `/metrics` is scraped, so the
step loop never touches Prometheus objects. Each server has its own
`CollectorRegistry`, so several simulators can live in one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from servegate.simulator.engine import Engine
from servegate.simulator.stats import FINISH_REASONS, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _gauge(
    name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(values), value)
    return family


def _counter(
    name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(values), value)
    return family


def _histogram(
    name: str, doc: str, labels: Sequence[str], values: Sequence[str], hist: Histogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(values), hist.cumulative(), hist.sum)
    return family


class VllmCollector(Collector):
    """vLLM v1's `PrometheusStatLogger` families, labelled `engine`, `model_name`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.labels = ("model_name", "engine")
        self.values = (engine.cfg.model, "0")

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        s = e.stats
        cfg = e.cfg
        lv = self.labels, self.values
        yield _gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            *lv,
            e.num_running,
        )
        yield _gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            *lv,
            e.num_waiting,
        )
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            *lv,
            e.kv.usage,
        )
        yield _counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            *lv,
            s.prefix_cache_queries,
        )
        yield _counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            *lv,
            s.prefix_cache_hits,
        )
        yield _counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            *lv,
            s.preemptions,
        )
        yield _counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", *lv, s.prompt_tokens
        )
        yield _counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            *lv,
            s.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*self.values, reason], s.finished.get(reason, 0))
        yield success
        yield _histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            *lv,
            s.request_prompt_tokens,
        )
        yield _histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            *lv,
            s.request_generation_tokens,
        )
        yield _histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            *lv,
            s.iteration_tokens,
        )
        yield _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            *lv,
            s.ttft,
        )
        yield _histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            *lv,
            s.itl,
        )
        yield _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            *lv,
            s.e2e,
        )
        yield _histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            *lv,
            s.queue_time,
        )
        yield _histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            *lv,
            s.inference_time,
        )
        yield _histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            *lv,
            s.prefill_time,
        )
        yield _histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            *lv,
            s.decode_time,
        )
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "kv_sharing_fast_prefill": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_blocks),
            "num_gpu_blocks_override": str(cfg.num_blocks),
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
            "swap_space": "4",
        }
        yield _gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            list(info.values()),
            1.0,
        )
        if e.lora is not None:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            for (running, waiting), ts in s.lora_info.items():
                lora.add_metric([str(cfg.lora.max_loras), waiting, running], ts)
            yield lora


class SglangCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.labels = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
        self.values = (engine.cfg.model, "unified", "0", "0", "0")

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        s = e.stats
        cfg = e.cfg
        lv = self.labels, self.values
        page = cfg.block_size
        usable = e.kv.usable_blocks
        used = usable - e.kv.num_free_blocks
        yield _gauge(
            "sglang:num_running_reqs", "The number of running requests.", *lv, e.num_running
        )
        yield _gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            *lv,
            e.num_waiting,
        )
        yield _gauge("sglang:token_usage", "The token usage.", *lv, e.kv.usage)
        yield _gauge("sglang:num_used_tokens", "The number of used tokens.", *lv, used * page)
        yield _gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache.",
            *lv,
            usable * page,
        )
        yield _gauge("sglang:page_size", "Tokens per KV page.", *lv, page)
        yield _gauge("sglang:num_pages", "KV pages.", *lv, cfg.num_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", *lv, hit_rate)
        yield _gauge(
            "sglang:cache_config_info",
            "Cache configuration.",
            [*self.labels, "page_size", "num_pages"],
            [*self.values, str(page), str(cfg.num_blocks)],
            1.0,
        )
        yield _counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", *lv, s.prompt_tokens
        )
        yield _counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            *lv,
            s.generation_tokens,
        )
        yield _counter(
            "sglang:cached_tokens", "Number of cached prompt tokens.", *lv, s.cached_prompt_tokens
        )
        yield _counter(
            "sglang:num_requests", "Number of requests processed.", *lv, sum(s.finished.values())
        )
        yield _histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            *lv,
            s.ttft,
        )
        yield _histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            *lv,
            s.itl,
        )
        yield _histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            *lv,
            s.e2e,
        )
        yield _histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", *lv, s.queue_time
        )


class TrtllmCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.labels = ("model_name", "engine_type", "pid")
        self.values = (engine.cfg.model, "trtllm", str(os.getpid()))

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        s = e.stats
        lv = self.labels, self.values
        yield _gauge(
            "trtllm_num_requests_running", "Number of running requests.", *lv, e.num_running
        )
        yield _gauge(
            "trtllm_num_requests_waiting", "Number of waiting requests.", *lv, e.num_waiting
        )
        yield _gauge("trtllm_kv_cache_utilization", "KV cache utilization.", *lv, e.kv.usage)
        yield _gauge(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block.", *lv, e.cfg.block_size
        )
        yield _gauge(
            "trtllm_kv_cache_max_blocks", "Maximum KV cache blocks.", *lv, e.kv.usable_blocks
        )
        yield _gauge(
            "trtllm_kv_cache_used_blocks",
            "Used KV cache blocks.",
            *lv,
            e.kv.usable_blocks - e.kv.num_free_blocks,
        )
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate.", *lv, hit_rate)
        bs = e.cfg.block_size
        yield _counter(
            "trtllm_kv_cache_reused_blocks",
            "Reused KV cache blocks.",
            *lv,
            s.prefix_cache_hits // bs,
        )
        yield _counter(
            "trtllm_kv_cache_missed_blocks",
            "Missed KV cache blocks.",
            *lv,
            max(0, s.prefix_cache_queries - s.prefix_cache_hits) // bs,
        )
        success = CounterMetricFamily(
            "trtllm_request_success",
            "Count of successfully processed requests.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*self.values, reason], s.finished.get(reason, 0))
        yield success
        yield _histogram("trtllm_time_to_first_token_seconds", "Time to first token.", *lv, s.ttft)
        yield _histogram(
            "trtllm_time_per_output_token_seconds", "Time per output token.", *lv, s.itl
        )
        yield _histogram(
            "trtllm_e2e_request_latency_seconds", "End-to-end request latency.", *lv, s.e2e
        )
        yield _histogram(
            "trtllm_request_queue_time_seconds", "Request queue time.", *lv, s.queue_time
        )


def trtllm_iteration_stats(engine: Engine) -> list[dict[str, object]]:
    """trtllm-serve's JSON `/metrics`: recent iteration statistics."""
    kv = engine.kv
    used = kv.usable_blocks - kv.num_free_blocks
    return [
        {
            "iter": engine.stats.steps,
            "iterLatencyMS": engine.stats.last_step_s * 1000.0,
            "numActiveRequests": engine.num_running,
            "numQueuedRequests": engine.num_waiting,
            "maxNumActiveRequests": engine.cfg.max_num_seqs,
            "gpuMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": kv.usable_blocks,
                "freeNumBlocks": kv.num_free_blocks,
                "usedNumBlocks": used,
                "tokensPerBlock": engine.cfg.block_size,
                "allocTotalBlocks": used,
                "reusedBlocks": engine.stats.prefix_cache_hits // engine.cfg.block_size,
            },
        }
    ]


class TritonCollector(Collector):
    """Triton's TensorRT-LLM backend families, labelled `model`, `version`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.cfg.model

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        s = e.stats
        kv = e.kv
        base = ("model", "version")
        values = (self.model, "1")
        requests = GaugeMetricFamily(
            "nv_trt_llm_request_metrics", "TRT LLM request metrics", labels=[*base, "request_type"]
        )
        for kind, value in (
            ("active", e.num_running + e.num_waiting),
            ("max", e.cfg.max_num_seqs),
            ("scheduled", e.num_running),
            ("context", sum(1 for r in e.running if r.num_computed < r.prompt_len)),
            ("waiting", e.num_waiting),
        ):
            requests.add_metric([*values, kind], value)
        yield requests
        blocks = GaugeMetricFamily(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            labels=[*base, "kv_cache_block_type"],
        )
        used = kv.usable_blocks - kv.num_free_blocks
        kv_values: tuple[tuple[str, float], ...] = (
            ("max", kv.usable_blocks),
            ("free", kv.num_free_blocks),
            ("used", used),
            ("tokens_per", e.cfg.block_size),
            ("fraction", kv.usage),
        )
        for kind, amount in kv_values:
            blocks.add_metric([*values, kind], amount)
        yield blocks
        general = GaugeMetricFamily(
            "nv_trt_llm_general_metrics", "General TRT LLM metrics", labels=[*base, "general_type"]
        )
        general.add_metric([*values, "iteration_counter"], s.steps)
        yield general
        done = sum(v for k, v in s.finished.items() if k != "abort")
        for name, doc, value in (
            ("nv_inference_request_success", "Number of successful inference requests", done),
            (
                "nv_inference_request_failure",
                "Number of failed inference requests",
                s.finished.get("abort", 0),
            ),
            ("nv_inference_count", "Number of inferences performed", done),
            ("nv_inference_exec_count", "Number of model executions performed", s.steps),
        ):
            metric = Metric(name, doc, "unknown")
            metric.add_sample(name, dict(zip(base, values, strict=True)), float(value))
            yield metric


_COLLECTORS: dict[
    str, type[VllmCollector | SglangCollector | TrtllmCollector | TritonCollector]
] = {
    "vllm": VllmCollector,
    "sglang": SglangCollector,
    "trtllm-serve": TrtllmCollector,
    "triton-tensorrt-llm": TritonCollector,
}


def build_registry(engine: Engine) -> CollectorRegistry:
    """A registry with the persona's families plus the process/GC/platform ones
    every prometheus_client server shows."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_COLLECTORS[engine.cfg.persona](engine))
    if engine.cfg.persona != "triton-tensorrt-llm":
        registry.register(ProcessCollector(registry=None))
        registry.register(PLATFORM_COLLECTOR)
        registry.register(GC_COLLECTOR)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
