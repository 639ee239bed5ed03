"""Triton Inference Server with the TensorRT-LLM backend.

Metrics live on their own port (8002 by default); readiness is
`GET /v2/health/ready` on the HTTP port (200 ready, 400 not ready, empty body).
The batch manager packs several signals into two gauge families told apart by a
label. KV utilisation is the `fraction` series where the backend publishes it,
else used / max blocks. Triton has no `/v1/models`.
"""

from servegate.engines.spec import Aggregation, EngineSpec, MetricSpec

METRICS_PORT = 8002
REQUESTS = "nv_trt_llm_request_metrics"
KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"


def _kv(kind: str, aggregation: Aggregation = Aggregation.SUM) -> MetricSpec:
    return MetricSpec(KV_BLOCKS, labels=(("kv_cache_block_type", kind),), aggregation=aggregation)


SPEC = EngineSpec(
    name="triton-tensorrt-llm",
    metrics_path="/metrics",
    metrics_port=METRICS_PORT,
    health_path="/v2/health/ready",
    openai_models=False,
    request_adapter="triton-generate",
    waiting=(MetricSpec(REQUESTS, labels=(("request_type", "waiting"),)),),
    running=(MetricSpec(REQUESTS, labels=(("request_type", "scheduled"),)),),
    kv_usage=(
        _kv("fraction", Aggregation.MEAN),
        MetricSpec(
            KV_BLOCKS,
            labels=(("kv_cache_block_type", "used"),),
            per=_kv("max"),
        ),
    ),
    block_size=(_kv("tokens_per", Aggregation.MAX),),
    num_blocks=(_kv("max"),),
)
