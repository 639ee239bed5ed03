from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import orjson
import pytest

from servegate.bench import text
from servegate.bench.workloads import (
    SESSION_HEADER,
    Api,
    BenchRequest,
    ChatMessage,
    LoraMixWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    Workload,
    with_poisson_timestamps,
    zipf_weights,
)

WORKLOADS: list[Workload] = [
    SharedPrefixWorkload(num_groups=3, prompts_per_group=4, system_prompt_len=20, question_len=5),
    MultiTurnWorkload(sessions=3, turns=3, system_prompt_len=10, question_len=4, output_len=6),
    LoraMixWorkload(adapters=("a1", "a2", "a3"), num_requests=20, prompt_len=12),
    RandomWorkload(num_requests=20, prompt_len=12, output_len=8),
]
IDS = [w.name for w in WORKLOADS]


@pytest.mark.parametrize("workload", WORKLOADS, ids=IDS)
@pytest.mark.parametrize("api", list(Api), ids=str)
def test_same_seed_gives_same_requests(workload: Workload, api: Api) -> None:
    first = workload.generate(model="m", api=api, seed=7)
    second = workload.generate(model="m", api=api, seed=7)
    assert first == second


@pytest.mark.parametrize("workload", WORKLOADS, ids=IDS)
def test_other_seed_gives_other_text(workload: Workload) -> None:
    first = workload.generate(model="m", api=Api.COMPLETIONS, seed=1)
    second = workload.generate(model="m", api=Api.COMPLETIONS, seed=2)
    assert [r.prompt for r in first] != [r.prompt for r in second]


def test_shared_prefix_shape() -> None:
    workload = SharedPrefixWorkload(
        num_groups=3, prompts_per_group=4, system_prompt_len=20, question_len=5, output_len=9
    )
    requests = workload.generate(model="m", api=Api.CHAT, seed=0)
    assert len(requests) == 12  # 3 groups x 4 prompts
    systems = Counter(r.messages[0].content for r in requests if r.messages)
    assert sorted(systems.values()) == [4, 4, 4]
    for request in requests:
        assert request.messages is not None
        system, user = request.messages
        assert (system.role, user.role) == ("system", "user")
        assert text.approx_tokens(system.content) == 20
        assert text.approx_tokens(user.content) == 5
        assert request.max_tokens == 9
    assert len({r.messages[1].content for r in requests if r.messages}) == 12


def test_shared_prefix_is_shuffled_across_groups() -> None:
    workload = SharedPrefixWorkload(num_groups=4, prompts_per_group=8, system_prompt_len=8)
    requests = workload.generate(model="m", api=Api.COMPLETIONS, seed=3)
    groups = [r.prompt.split()[:8] if r.prompt else [] for r in requests]
    first_eight = {tuple(g) for g in groups[:8]}
    assert len(first_eight) > 1


def test_shared_prefix_completion_prompt_is_system_then_question() -> None:
    workload = SharedPrefixWorkload(num_groups=1, prompts_per_group=2, system_prompt_len=30)
    first, second = workload.generate(model="m", api=Api.COMPLETIONS, seed=0)
    assert first.prompt is not None
    assert second.prompt is not None
    assert first.prompt.split()[:30] == second.prompt.split()[:30]
    assert text.approx_tokens(first.prompt) == 30 + 64  # system + default question_len


def test_multi_turn_history_grows_turn_by_turn() -> None:
    workload = MultiTurnWorkload(
        sessions=2, turns=3, system_prompt_len=10, question_len=4, output_len=6
    )
    requests = workload.generate(model="m", api=Api.CHAT, seed=0)
    assert len(requests) == 6  # 2 sessions x 3 turns, turn-major order
    by_session: dict[str, list[BenchRequest]] = {}
    for request in requests:
        assert request.session_id is not None
        by_session.setdefault(request.session_id, []).append(request)
    assert len(by_session) == 2
    for turns in by_session.values():
        for turn, request in enumerate(turns):
            assert request.messages is not None
            # system + turn x (user, assistant) + the new user message
            assert len(request.messages) == 2 + 2 * turn
            assert request.messages[-1].role == "user"
            assert [m.role for m in request.messages[1::2]] == ["user"] * (turn + 1)
        for earlier, later in itertools.pairwise(turns):
            assert earlier.messages is not None
            assert later.messages is not None
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert text.approx_tokens(later.messages[len(earlier.messages)].content) == 6
    # turn-major: session 0 turn 0, session 1 turn 0, session 0 turn 1, ...
    assert requests[0].session_id != requests[1].session_id
    assert requests[2].session_id == requests[0].session_id


def test_multi_turn_completions_prompt_extends_previous_prompt() -> None:
    workload = MultiTurnWorkload(sessions=1, turns=2, system_prompt_len=5, question_len=3)
    first, second = workload.generate(model="m", api=Api.COMPLETIONS, seed=0)
    assert first.prompt is not None
    assert second.prompt is not None
    assert second.prompt.startswith(first.prompt)
    assert first.headers[SESSION_HEADER] == second.headers[SESSION_HEADER]


def test_lora_mix_is_skewed_towards_first_adapter() -> None:
    workload = LoraMixWorkload(adapters=("a1", "a2", "a3"), skew=1.0, num_requests=3000)
    counts = Counter(r.model for r in workload.generate(model="base", api=Api.CHAT, seed=0))
    assert counts["a1"] > counts["a2"] > counts["a3"]
    # weights 1, 1/2, 1/3 normalised: a1 = 1 / (11/6) = 0.545
    assert counts["a1"] / 3000 == pytest.approx(0.545, abs=0.04)


@pytest.mark.parametrize(
    ("count", "skew", "expected"),
    [
        pytest.param(3, 0.0, [1 / 3, 1 / 3, 1 / 3], id="skew-0-uniform"),
        pytest.param(3, 1.0, [6 / 11, 3 / 11, 2 / 11], id="skew-1"),  # 1, 1/2, 1/3 over 11/6
        pytest.param(2, 2.0, [0.8, 0.2], id="skew-2"),  # 1, 1/4 over 5/4
    ],
)
def test_zipf_weights(count: int, skew: float, expected: list[float]) -> None:
    assert zipf_weights(count, skew) == pytest.approx(expected)


def test_random_lengths_stay_in_spread() -> None:
    workload = RandomWorkload(num_requests=200, prompt_len=100, output_len=20, spread=0.5)
    requests = workload.generate(model="m", api=Api.COMPLETIONS, seed=0)
    lengths = [text.approx_tokens(r.prompt or "") for r in requests]
    assert min(lengths) >= 50
    assert max(lengths) <= 150
    assert len(set(lengths)) > 10
    assert all(10 <= r.max_tokens <= 30 for r in requests)  # 20 x (1 +- 0.5)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: SharedPrefixWorkload(num_groups=0), id="no-groups"),
        pytest.param(lambda: MultiTurnWorkload(turns=0), id="no-turns"),
        pytest.param(lambda: LoraMixWorkload(adapters=()), id="no-adapters"),
        pytest.param(lambda: LoraMixWorkload(adapters=("a",), skew=-1), id="negative-skew"),
        pytest.param(lambda: RandomWorkload(spread=1.0), id="spread-1"),
        pytest.param(lambda: BenchRequest("m", 4), id="no-prompt"),
        pytest.param(
            lambda: BenchRequest("m", 4, prompt="x", messages=(ChatMessage("user", "y"),)),
            id="prompt-and-messages",
        ),
        pytest.param(lambda: BenchRequest("m", 0, prompt="x"), id="zero-max-tokens"),
    ],
)
def test_bad_parameters_are_rejected(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=r"."):
        build()


@pytest.mark.parametrize(
    ("request_", "stream", "expected"),
    [
        pytest.param(
            BenchRequest("m", 4, prompt="hi"),
            False,
            {"model": "m", "max_tokens": 4, "prompt": "hi", "stream": False},
            id="completion",
        ),
        pytest.param(
            BenchRequest("m", 4, messages=(ChatMessage("user", "hi"),)),
            True,
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            id="chat-stream",
        ),
    ],
)
def test_body(request_: BenchRequest, stream: bool, expected: dict[str, object]) -> None:
    assert orjson.loads(request_.body(stream=stream)) == expected


def test_body_ignore_eos_and_paths() -> None:
    completion = BenchRequest("m", 4, prompt="hi")
    chat = BenchRequest("m", 4, messages=(ChatMessage("user", "hi"),))
    assert orjson.loads(completion.body(stream=False, ignore_eos=True))["ignore_eos"] is True
    assert (completion.path, chat.path) == ("/v1/completions", "/v1/chat/completions")


def test_tagged_prefixes_first_text_only() -> None:
    chat = BenchRequest(
        "m", 4, messages=(ChatMessage("system", "s"), ChatMessage("user", "u")), headers={}
    )
    tagged = chat.tagged("<t> ")
    assert tagged.messages == (ChatMessage("system", "<t> s"), ChatMessage("user", "u"))
    assert BenchRequest("m", 4, prompt="p").tagged("<t> ").prompt == "<t> p"


def test_headers_are_lowercased_and_read_only() -> None:
    request = BenchRequest("m", 4, prompt="p", headers={"X-Session-Id": "s1"})
    assert request.session_id == "s1"
    with pytest.raises(TypeError):
        request.headers["x"] = "y"  # type: ignore[index]


def test_poisson_timestamps_are_seeded_and_average_one_over_rate() -> None:
    requests = [BenchRequest("m", 1, prompt="p")] * 2000
    first = with_poisson_timestamps(requests, rate=10.0, seed=5)
    assert first == with_poisson_timestamps(requests, rate=10.0, seed=5)
    stamps = [r.timestamp for r in first]
    assert stamps[0] == 0.0
    assert stamps == sorted(stamps)
    # 1999 gaps of mean 1/10 s: about 200 s
    assert stamps[-1] == pytest.approx(199.9, rel=0.1)
