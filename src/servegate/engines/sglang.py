"""SGLang (`--enable-metrics`): `/metrics` and `/health` on the API port.

Series carry `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`
(and `dp_rank` with data-parallel attention). Older builds spell families with an
`sglang_` prefix instead of `sglang:`; both are accepted. The prefix-cache pair is
read from the prompt-token counters: `cached_tokens_total` counts prompt tokens
served from the radix cache, `prompt_tokens_total` every prompt token. Every
rank reports the same cache geometry, so block size and page count take the max.
"""

from servegate.engines.spec import Aggregation, EngineSpec, MetricSpec


def _family(
    suffix: str, label: str | None = None, aggregation: Aggregation = Aggregation.SUM
) -> MetricSpec:
    return MetricSpec(
        f"sglang:{suffix}",
        alternatives=(f"sglang_{suffix}",),
        label=label,
        aggregation=aggregation,
    )


SPEC = EngineSpec(
    name="sglang",
    metrics_path="/metrics",
    health_path="/health",
    waiting=(_family("num_queue_reqs"),),
    running=(_family("num_running_reqs"),),
    kv_usage=(_family("token_usage", aggregation=Aggregation.MEAN),),
    block_size=(
        _family("cache_config_info", label="page_size", aggregation=Aggregation.MAX),
        _family("page_size", aggregation=Aggregation.MAX),
    ),
    num_blocks=(
        _family("cache_config_info", label="num_pages", aggregation=Aggregation.MAX),
        _family("num_pages", aggregation=Aggregation.MAX),
    ),
    prefix_cache_queries=(_family("prompt_tokens_total"),),
    prefix_cache_hits=(_family("cached_tokens_total"),),
)
