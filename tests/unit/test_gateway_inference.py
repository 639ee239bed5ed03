import os
import re

import pytest
from multidict import CIMultiDict

from servegate.gateway.inference import IDS, IDS_PER_READ, RandomIds, request_id


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


def test_ids_stay_distinct_across_refills() -> None:
    ids = RandomIds()
    seen = [ids.next() for _ in range(3 * IDS_PER_READ + 5)]
    assert len(set(seen)) == len(seen)
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in seen)


def test_a_forked_child_never_repeats_its_parents_ids() -> None:
    IDS.next()  # bytes are buffered now, which a child would otherwise inherit
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out without pytest's teardown
        os.close(read)
        os.write(write, ",".join(IDS.next() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode().split(",")
    os.waitpid(pid, 0)
    parent = [IDS.next() for _ in range(4)]
    assert len(child) == 4
    assert not set(child) & set(parent)
