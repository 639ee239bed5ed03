import re

import pytest
from multidict import CIMultiDict

from servegate.gateway.inference import request_id


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
    headers = CIMultiDict({} if header is None else {"x-request-id": header})
    rid = request_id(headers)
    if kept:
        assert rid == header
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)


def test_generated_request_ids_differ() -> None:
    headers: CIMultiDict[str] = CIMultiDict()
    assert len({request_id(headers) for _ in range(100)}) == 100
