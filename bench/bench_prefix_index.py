"""Microbenchmark of the approximate prefix index's match and insertion (not a test).

The cases the scheduler's "prompt held by 3 replicas" row pays for, and what recording a
decision costs after it:

- `match`: a 256-block prompt held whole by 3 replicas, asked about 67 candidates (a
  1,000-endpoint pool's shortlist), the keys hashed anew (fresh int objects) as each
  request hashes its own prompt;
- `match, the next turn`: a 230-block prompt whose first 200 blocks are a chain the 3
  holders were sent (a conversation's next turn; the rest is new to everyone);
- `match, 1 of 3 lost a block`: the same, one holder's LRU having dropped a block
  from the middle of the chain (the walk cannot be skipped for that one);
- `insert held`: re-recording a chain the replica holds (`pre_request` after a sticky
  decision);
- `insert evicting`: recording a new 256-block chain into a full LRU.

Times the servegate it imports, so two checkouts compare with PYTHONPATH:

    PYTHONPATH=src .venv/bin/python bench/bench_prefix_index.py
    PYTHONPATH=../other/src .venv/bin/python bench/bench_prefix_index.py
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time
from collections.abc import Callable

from servegate.scheduling.prefix.approx import ApproxPrefixIndex

BLOCKS = 256
CHAINED = (
    {"chained": True} if "chained" in inspect.signature(ApproxPrefixIndex.insert).parameters else {}
)
"""How `PrefixCacheScorer` calls the index (its keys are hash chains), where the checkout
timed knows that flag."""


def _fresh(keys: list[int]) -> list[int]:
    """Equal keys as new objects, as another request's hashing would produce them."""
    return [int(str(k)) for k in keys]


def _time(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Median over `rounds` of the mean µs per call over `n` calls (CPU clock)."""
    per: list[float] = []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        per.append((time.thread_time_ns() - t0) / n / 1000.0)
    return statistics.median(per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(7)
    addresses = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(1000)]
    chain = [rng.getrandbits(64) for _ in range(BLOCKS)]
    holders = rng.sample(addresses, 3)
    asked = sorted({*rng.sample(addresses, 64), *holders})

    index = ApproxPrefixIndex(31250)
    for address in holders:
        index.insert(address, _fresh(chain), **CHAINED)
    request = _fresh(chain)
    turn_index = ApproxPrefixIndex(31250)
    for address in holders:
        turn_index.insert(address, _fresh(chain[:200]), **CHAINED)
    next_turn = [*_fresh(chain[:200]), *(rng.getrandbits(64) for _ in range(30))]
    assert turn_index.match_lengths(next_turn, holders, **CHAINED) == dict.fromkeys(holders, 200)
    lost = ApproxPrefixIndex(8 * BLOCKS)
    for address in holders:
        lost.insert(address, _fresh(chain), **CHAINED)
    lost.insert(holders[2], chain[:100], **CHAINED)  # the third's oldest block is now block 100
    lost.insert(
        holders[2], [rng.getrandbits(64) for _ in range(7 * BLOCKS + 1)], **CHAINED
    )  # evicts it
    assert lost.match_lengths(request, holders, **CHAINED) == {
        holders[0]: BLOCKS,
        holders[1]: BLOCKS,
        holders[2]: 100,
    }

    held = ApproxPrefixIndex(31250)
    held.insert(holders[0], _fresh(chain), **CHAINED)
    resent = _fresh(chain)
    full = ApproxPrefixIndex(8 * BLOCKS)
    new_chains = [[rng.getrandbits(64) for _ in range(BLOCKS)] for _ in range(64)]
    turn = iter(range(1 << 62))

    cases: dict[str, Callable[[], object]] = {
        "match, 3 holders of 256 blocks, 67 asked": lambda: index.match_lengths(
            request, asked, **CHAINED
        ),
        "match, the next turn (200 of 230 blocks held)": lambda: turn_index.match_lengths(
            next_turn, asked, **CHAINED
        ),
        "match, 1 of 3 lost a block": lambda: lost.match_lengths(request, asked, **CHAINED),
        "insert held (re-record 256 blocks)": lambda: held.insert(holders[0], resent, **CHAINED),
        "insert evicting (256 new blocks, full LRU)": lambda: full.insert(
            holders[1], new_chains[next(turn) % 64], **CHAINED
        ),
    }
    for label, fn in cases.items():
        print(f"{label:45s} {_time(fn, args.n, args.rounds):7.2f} µs")


if __name__ == "__main__":
    main()
