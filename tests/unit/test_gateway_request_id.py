import re

import pytest
from aiohttp.test_utils import make_mocked_request

from servegate.gateway.app import _request_id


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        ("req-1", True),
        ("x" * 128, True),
        (None, False),
        ("", False),
        ("x" * 129, False),
        ("a\x01b", False),
    ],
    ids=["client-id", "longest-kept", "absent", "empty", "too-long", "unprintable"],
)
def test_request_id_is_the_clients_or_32_hex_digits(header: str | None, kept: bool) -> None:
    headers = {} if header is None else {"X-Request-ID": header}
    rid = _request_id(make_mocked_request("POST", "/v1/chat/completions", headers=headers))
    if kept:
        assert rid == header
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)


def test_generated_request_ids_differ() -> None:
    request = make_mocked_request("POST", "/v1/chat/completions")
    assert len({_request_id(request) for _ in range(100)}) == 100
