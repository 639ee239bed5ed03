"""TensorRT-LLM's `trtllm-serve`: Prometheus text on `/prometheus/metrics`.

The plain `/metrics` route answers JSON iteration stats, not Prometheus. Gauges
appear only when the server runs with `return_perf_metrics: true` and
`enable_iter_perf_stats: true`; series carry `model_name`, `engine_type`, `pid`.
Some builds spell families `trtllm:` instead of `trtllm_`; both are accepted.
"""

from servegate.engines.spec import Aggregation, EngineSpec, MetricSpec


def _family(suffix: str, aggregation: Aggregation = Aggregation.SUM) -> MetricSpec:
    return MetricSpec(
        f"trtllm_{suffix}", alternatives=(f"trtllm:{suffix}",), aggregation=aggregation
    )


SPEC = EngineSpec(
    name="trtllm-serve",
    metrics_path="/prometheus/metrics",
    health_path="/health",
    waiting=(_family("num_requests_waiting"),),
    running=(_family("num_requests_running"),),
    kv_usage=(_family("kv_cache_utilization", Aggregation.MEAN),),
    block_size=(_family("kv_cache_tokens_per_block", Aggregation.MAX),),
    num_blocks=(_family("kv_cache_max_blocks", Aggregation.SUM),),
)
