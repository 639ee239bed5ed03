"""Do two checkouts' schedulers make the same decisions? (a check, not a benchmark)

Replays the same seeded traffic through the default and heavy profiles of
`bench_scheduler.py` in this checkout and in `--against DIR` (each in its own
interpreter, importing DIR/src): pools of 2 to 1,000 endpoints with random load and
LoRA state, prompts from a few families (so replicas hold them after the first) and
new ones, adapter requests, the prefix index fed after every decision. Prints how
many decisions (target, first fallbacks, the target's total score) are identical.

    .venv/bin/python bench/scheduler_decisions.py --against /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

SIZES = (2, 8, 100, 1000)


def replay(decisions: int) -> list[list[Any]]:
    """What this interpreter's servegate decides on the seeded traffic."""
    from bench_scheduler import HEAVY_PICKER_CONFIG
    from servegate.pool.endpoint import LoraInfo, Role
    from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
    from servegate.scheduling.factory import PluginContext
    from servegate.scheduling.framework import CycleState
    from servegate.scheduling.request import LLMRequest, RequestKind
    from servegate.testing.endpoints import random_endpoint_states

    out: list[list[Any]] = []
    for name, config in (("default", DEFAULT_PICKER_CONFIG), ("heavy", HEAVY_PICKER_CONFIG)):
        for size in SIZES:
            rng = random.Random(size)
            scheduler = load_picker_config(config, PluginContext(staleness_s=2.0))
            states = random_endpoint_states(size, rng, roles=[Role.DECODE, Role.BOTH])
            for s in states:
                running = frozenset(rng.sample(["a1", "a2", "a3", "a4"], rng.randint(0, 2)))
                s.metrics.lora = LoraInfo(max_lora=2, running=running)
            cycle_rng = random.Random(size + 1)
            for i in range(decisions):
                family = rng.randrange(12) if rng.random() < 0.7 else 1000 + i
                lora = rng.choice([None, None, "a1", "a3"])
                prompt = f"family {family} " * 300 + f"turn {i % 5}" * rng.randint(0, 3)
                model = lora or "base"
                request = LLMRequest(
                    request_id=f"r{i}",
                    kind=RequestKind.CHAT,
                    model=model,
                    target_model=model,
                    base_model="base",
                    lora=lora,
                    prompt=prompt,
                    messages=[{"role": "user", "content": prompt}],
                    prompt_tokens=len(prompt) // 4,
                    max_tokens=64,
                )
                cycle = CycleState(now=100.0 + i * 1e-3, rng=cycle_rng)
                decision = scheduler.schedule(request, states, cycle)
                total = decision.results["default"].totals[decision.endpoint.address]
                fallbacks = [f.address for f in decision.fallbacks[:4]]
                out.append([name, size, i, decision.endpoint.address, fallbacks, total])
                scheduler.pre_request(request, decision, cycle.now)
                decision.endpoint.in_flight_requests += 1
                decision.endpoint.in_flight_tokens += request.prompt_tokens
                done = states[rng.randrange(size)]
                if rng.random() < 0.6 and done.in_flight_requests:
                    done.in_flight_requests -= 1
                    done.in_flight_tokens = max(0, done.in_flight_tokens - 2000)
    return out


def _in_process(src: Path, decisions: int) -> list[list[Any]]:
    cmd = [sys.executable, __file__, "--worker", "--decisions", str(decisions)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(Path(__file__).parent)])}
    done = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    result: list[list[Any]] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="the other checkout (its src/)")
    parser.add_argument("--decisions", type=int, default=300, help="per profile and pool size")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(replay(args.decisions)))
        return 0
    if args.against is None:
        parser.error("--against is required")
    ours = _in_process(Path(__file__).resolve().parent.parent / "src", args.decisions)
    theirs = _in_process(args.against.resolve() / "src", args.decisions)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    print(f"{len(ours) - len(differ)} of {len(ours)} decisions identical")
    for a, b in differ[:10]:
        print(f"  this {a}\n  that {b}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
