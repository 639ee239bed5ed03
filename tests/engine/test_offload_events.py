"""CPU-offload KV events from vLLM's own scheduler, consumed by servegate's precise index.

A running vLLM cannot offload on this CPU-only machine: both CPU-offloading
connectors move KV data with CUDA streams (the `OffloadingConnector` worker raises
"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" when it
registers its KV caches, `SimpleCPUOffloadConnector` calls
`torch.cuda.Stream.priority_range()`). Everything that *decides and announces* an
offload is scheduler-side Python, so each replica here is vLLM's real engine-core
`Scheduler` (vLLM 0.32) built from the tiny model's real `VllmConfig`, with
`--kv-transfer-config` `OffloadingConnector` (scheduler role, real
`CPUOffloadingManager` with LRU, real `OffloadingEventsTracker` with
`self_describing_kv_events`) and `--kv-events-config` zmq on an `ipc://` endpoint
(the real `ZmqEventPublisher`). Requests carry the tiny tokenizer's token ids and
vLLM's own block hasher. The one stand-in is the model runner: each step reports
one sampled token per finished prefill and every transfer job the connector issued
as completed, which is what the GPU worker reports once its CUDA copy is done (here
the copy itself never happens). servegate's `KVEventsManager` subscribes to the
publishers, and the precise scorer scores from what arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from servegate.datalayer.kvevents import KVEventsManager
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState
from servegate.scheduling.prefix.events import BlockRemoved, BlockStored, EventBatch
from servegate.scheduling.prefix.precise import PreciseIndex, PrecisePrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.tinymodel import TinyModel

BLOCK = 32
GPU_BLOCKS = 16
CPU_CHUNKS = 32
GPU_WEIGHT, CPU_WEIGHT = 1.0, 0.8
# building a VllmConfig in-process imports torch's inductor, which warns about its own API
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "router",
    "cache",
    "block",
    "token",
    "prefix",
    "replica",
    "engine",
    "queue",
]


def prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


class OffloadReplica:
    """vLLM's scheduler with the CPU-offloading connector, publishing its KV events."""

    def __init__(self, model: TinyModel, name: str, workdir: Path) -> None:
        import torch
        from transformers import AutoTokenizer
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.config.kv_events import KVEventsConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        spec = model.spec
        model_dir = str(model.model_dir)
        self.address = f"127.0.0.1:{name}"
        self.endpoint = f"ipc://{workdir}/kv-{name}.sock"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache.num_gpu_blocks = GPU_BLOCKS
        head = spec.hidden_size // spec.num_heads
        kv = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=spec.num_kv_heads, head_size=head, dtype=torch.float32
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(spec.num_layers)]
        page = kv.page_size_bytes
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, dtype="float32", max_model_len=2048),
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=2048,
                max_num_seqs=4,
                max_model_len=2048,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    # the CPU tier: one chunk per 32-token block, page bytes each
                    "cpu_bytes_to_use": CPU_CHUNKS * page * spec.num_layers,
                    "self_describing_kv_events": True,
                },
            ),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.endpoint,
                topic=f"kv@{self.address}@tiny",
            ),
        )
        kv_cache = KVCacheConfig(
            num_blocks=GPU_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * GPU_BLOCKS * len(layers),
                    layers=layers,
                    layer_stride=page * GPU_BLOCKS,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(layers, kv)],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self._ids = itertools.count()
        self.cpu_chunks = self.scheduler.connector.connector_scheduler.manager._num_chunks
        self.held_jobs: dict[int, int] = {}
        """Transfer jobs issued but not yet reported done (see `complete(hold=True)`)."""
        self.held_loads: set[str] = set()
        """Requests whose CPU → GPU load is issued but not yet reported done."""
        self.loads = 0
        """Load jobs (CPU → GPU) the connector issued: what vLLM itself would read back."""
        self.published: list[Any] = []
        publish = self.scheduler.kv_event_publisher.publish

        def record(batch: Any) -> None:
            self.published.append(batch)
            publish(batch)

        self.scheduler.kv_event_publisher.publish = record  # type: ignore[method-assign]

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def complete(self, text: str, hold: bool = False) -> list[int]:
        """Run one prompt (max_tokens 1) to the end, and every offload job it starts.

        `hold`: its transfer jobs are reported done only by a later `release()`, as a
        slow copy would be."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        tokens = self.tokens(text)
        request = Request(
            f"req-{next(self._ids)}",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        self._run(hold)
        return tokens

    def release(self) -> None:
        """The held copies finish now."""
        self._run(False)

    def reset(self) -> None:
        """`/reset_prefix_cache?reset_external=true`: GPU and CPU caches both."""
        assert self.scheduler.reset_prefix_cache(reset_connector=True)

    def _run(self, hold: bool) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        s = self.scheduler
        connector = s.connector.connector_scheduler
        for _ in range(50):
            out = s.schedule()
            meta = out.kv_connector_metadata
            if meta is not None:
                self.loads += len(meta.load_jobs)
                for job in (*meta.store_jobs, *meta.load_jobs):
                    self.held_jobs[job] = 1
                self.held_loads.update(job.req_id for job in meta.load_jobs.values())
            done: dict[int, int] = {}
            loaded: set[str] = set()
            if not hold:
                done, self.held_jobs = self.held_jobs, {}
                loaded, self.held_loads = self.held_loads, set()
            ids = [r.req_id for r in out.scheduled_new_reqs]
            ids += list(out.scheduled_cached_reqs.req_ids)
            sampled = [
                [7] if s.requests[i].num_computed_tokens >= s.requests[i].num_prompt_tokens else []
                for i in ids
            ]
            s.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={i: n for n, i in enumerate(ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_recving=loaded,
                        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
                    ),
                ),
            )
            if not s.has_unfinished_requests() and (hold or not connector.has_pending_push_work()):
                return
        raise AssertionError("the scheduler did not finish the request in 50 steps")

    def events(self, since: int = 0) -> list[Any]:
        return [e for batch in self.published[since:] for e in batch.events]

    def close(self) -> None:
        self.scheduler.shutdown()


class RecordingIndex(PreciseIndex):
    """The scorer's index, also keeping every batch it was fed (for the assertions)."""

    def __init__(self, index: PreciseIndex) -> None:
        self.__dict__.update(index.__dict__)
        self.batches: list[tuple[str, EventBatch]] = []

    def apply(self, address: str, batch: EventBatch) -> None:
        self.batches.append((address, batch))
        super().apply(address, batch)


class Rig:
    def __init__(self, replicas: list[OffloadReplica], manager: KVEventsManager) -> None:
        self.replicas = replicas
        self.manager = manager
        self.scorer = PrecisePrefixCacheScorer.from_config(
            "precise",
            {
                "indexerConfig": {
                    "kvCacheBackendConfigs": [
                        {"name": "gpu", "weight": GPU_WEIGHT},
                        {"name": "cpu", "weight": CPU_WEIGHT},
                    ]
                }
            },
            PluginContext(),
        )
        self.index = RecordingIndex(self.scorer.index)
        self.scorer.index = self.index
        manager.indexes = [self.index]
        self.states = [EndpointState(Endpoint(address=r.address, url="http://x")) for r in replicas]

    def scores(self, tokens: list[int]) -> list[float]:
        request = LLMRequest("r", RequestKind.COMPLETION, "tiny", "tiny", "tiny", prompt="x")
        request.cache["token_ids"] = tokens
        cycle = CycleState(now=0.0, rng=random.Random(0))
        return [round(s, 6) for s in self.scorer.score(cycle, request, self.states)]

    def tiers(self, replica: OffloadReplica, tokens: list[int]) -> tuple[int, int]:
        """(leading blocks on GPU, leading blocks on CPU) of a prompt, as the index holds."""
        return (
            self.index.tier_blocks(replica.address, tokens, "gpu"),
            self.index.tier_blocks(replica.address, tokens, "cpu"),
        )

    def caught_up(self) -> bool:
        """Every replica's last published batch has reached the index (ZeroMQ keeps order;
        batches sent before a subscription took hold are lost, so counts would not do)."""
        arrived = {(address, batch.ts) for address, batch in self.index.batches}
        return all((r.address, r.published[-1].ts) in arrived for r in self.replicas if r.published)

    async def settle(self, what: str, condition: Callable[[], bool], timeout_s: float = 10) -> None:
        """Until everything published has reached the index and `condition` holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (self.caught_up() and condition()):
            if loop.time() > deadline:
                raise AssertionError(
                    f"{what}: caught up {self.caught_up()}; index {self.index.stats}"
                )
            await asyncio.sleep(0.02)


@pytest.fixture
async def rig(tiny_model: TinyModel, tmp_path: Path) -> AsyncIterator[Rig]:
    replicas = [OffloadReplica(tiny_model, name, tmp_path) for name in ("8201", "8202")]
    pool = Pool()
    for r in replicas:
        pool.add(Endpoint(address=r.address, url=f"http://{r.address}", kv_events=r.endpoint))
    manager = KVEventsManager(pool, [])
    rig = Rig(replicas, manager)
    await manager.start()
    try:
        await manager.wait_ready()
        for r in replicas:  # the slow joiner: send until a batch arrives
            for attempt in range(100):
                r.complete(prompt(f"join-{r.address}-{attempt}", 40))
                await asyncio.sleep(0.05)
                if rig.index.blocks(r.address):
                    break
            else:
                raise AssertionError(f"no KV events from {r.endpoint}")
        yield rig
    finally:
        await manager.stop()
        for r in replicas:
            r.close()


async def test_tier_weights_follow_real_offload_events(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    r0, r1 = rig.replicas
    text = prompt("offload-shared", 200)
    mark = len(r0.published)
    tokens = r0.complete(text)
    full = len(tokens) // BLOCK
    assert full >= 5, len(tokens)
    await rig.settle("r0's GPU and CPU stores", lambda: rig.tiers(r0, tokens) == (full, full))
    # what vLLM announced for the offload: self-describing CPU stores, 0.32's new fields
    cpu_stored = [e for e in r0.events(mark) if type(e).__name__ == "BlockStored"]
    cpu_stored = [e for e in cpu_stored if e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in cpu_stored) >= full
    assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in cpu_stored} == {
        (BLOCK, 0, "full_attention")
    }
    # GPU and CPU: the GPU weight
    assert rig.scores(tokens) == [GPU_WEIGHT, 0.0]

    # r1 computes it too, then other prompts push it out of r1's GPU (16 blocks) only
    r1.complete(text)
    await rig.settle("r1's stores", lambda: rig.tiers(r1, tokens) == (full, full))
    for i in range(3):
        r1.complete(prompt(f"offload-filler-{i}", 200))
    await rig.settle("r1's GPU evictions", lambda: rig.tiers(r1, tokens) == (0, full))
    assert rig.scores(tokens) == [GPU_WEIGHT, CPU_WEIGHT]
    # vLLM agrees the CPU tier holds it: asked again, r1's connector loads it from CPU
    loads = r1.loads
    r1.complete(text)
    assert r1.loads > loads
    await rig.settle("r1 loaded back to GPU", lambda: rig.tiers(r1, tokens) == (full, full))
    assert rig.scores(tokens) == [GPU_WEIGHT, GPU_WEIGHT]

    # more prompts than r1's CPU tier holds: CPU BlockRemoved, then nothing is left
    mark = len(r1.published)
    for i in range(r1.cpu_chunks // full + 3):
        r1.complete(prompt(f"offload-flood-{i}", 200))
    await rig.settle("r1's CPU evictions", lambda: rig.tiers(r1, tokens) == (0, 0))
    removed_cpu = {
        h
        for e in r1.events(mark)
        if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"
        for h in e.block_hashes
    }
    assert len(removed_cpu) >= full
    assert rig.scores(tokens) == [GPU_WEIGHT, 0.0]

    # reset with the connector (GPU and CPU): vLLM says AllBlocksCleared, nothing remains
    r0.reset()
    r0.complete(prompt("after-reset", 10))
    await rig.settle("r0's clear", lambda: rig.index.blocks(r0.address) == 0)
    assert rig.scores(tokens) == [0.0, 0.0]

    # every event decoded, none dropped, nothing warned
    for address, stats in rig.manager.stats().items():
        assert stats.dropped == {} and stats.sink_errors == 0 and stats.gaps == 0, address
        assert stats.events.get("BlockStored", 0) > 0, address
    assert rig.index.stats.unknown_parent == 0
    kinds = {type(e) for _, b in rig.index.batches for e in b.events}
    assert {BlockStored, BlockRemoved} <= kinds
    assert not [r for r in caplog.records if r.name.startswith("servegate")]


async def test_slow_copies_after_gpu_eviction_land_on_the_cpu_tier(rig: Rig) -> None:
    """A copy still running when the GPU evicts the chain: vLLM then announces the CPU
    stores with no GPU parent left, one self-contained event per chunk in the CPU
    manager's completion order (a set's: children may precede parents)."""
    r0 = rig.replicas[0]
    tokens = r0.complete(prompt("offload-slow-copy", 200), hold=True)
    full = len(tokens) // BLOCK
    await rig.settle("GPU stores", lambda: rig.tiers(r0, tokens) == (full, 0))
    for i in range(3):  # 16 GPU blocks: these push the prompt out while its copy runs
        r0.complete(prompt(f"offload-slow-filler-{i}", 200), hold=True)
    await rig.settle("GPU evictions", lambda: rig.tiers(r0, tokens) == (0, 0))
    mark = len(r0.published)
    r0.release()
    await rig.settle("the late CPU stores", lambda: rig.tiers(r0, tokens) == (0, full))
    assert rig.scores(tokens) == [CPU_WEIGHT, 0.0]
    assert rig.index.stats.unknown_parent == 0
    late = [e for e in r0.events(mark) if type(e).__name__ == "BlockStored"]
    assert {e.medium for e in late} == {"CPU"}
    # vLLM agrees: the prompt is loaded back from its CPU tier
    loads = r0.loads
    r0.complete(prompt("offload-slow-copy", 200))
    assert r0.loads > loads
