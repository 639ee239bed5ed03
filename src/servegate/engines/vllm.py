"""vLLM's OpenAI server: `/metrics` and `/health` on the API port.

Every engine series carries `model_name` and `engine` (the data-parallel index):
requests add up over engines, KV utilisation averages. The cache geometry is in
the labels of `vllm:cache_config_info` (one series per engine, fixed at 1).
"""

from servegate.engines.spec import Aggregation, EngineSpec, MetricSpec

CACHE_CONFIG_INFO = "vllm:cache_config_info"

SPEC = EngineSpec(
    name="vllm",
    metrics_path="/metrics",
    health_path="/health",
    waiting=(MetricSpec("vllm:num_requests_waiting"),),
    running=(MetricSpec("vllm:num_requests_running"),),
    kv_usage=(
        MetricSpec(
            "vllm:kv_cache_usage_perc",
            alternatives=("vllm:gpu_cache_usage_perc",),
            aggregation=Aggregation.MEAN,
        ),
    ),
    block_size=(MetricSpec(CACHE_CONFIG_INFO, label="block_size", aggregation=Aggregation.MAX),),
    num_blocks=(
        MetricSpec(CACHE_CONFIG_INFO, label="num_gpu_blocks", aggregation=Aggregation.SUM),
    ),
    lora=(MetricSpec("vllm:lora_requests_info", aggregation=Aggregation.LATEST_BY_VALUE),),
    prefix_cache_queries=(
        MetricSpec(
            "vllm:prefix_cache_queries_total",
            alternatives=("vllm:gpu_prefix_cache_queries_total",),
        ),
    ),
    prefix_cache_hits=(
        MetricSpec(
            "vllm:prefix_cache_hits_total",
            alternatives=("vllm:gpu_prefix_cache_hits_total",),
        ),
    ),
    rank_label="engine",
)
