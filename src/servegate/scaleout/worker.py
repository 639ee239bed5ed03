"""One worker process: `python -m servegate.scaleout.worker`, started by the supervisor.

It reads its identity and the resolved config from the supervisor (see
`WorkerIdentity`), binds the shared port with SO_REUSEPORT and serves until
SIGTERM. It exits by itself if the supervisor disappears.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from servegate.config import ServegateConfig
from servegate.gateway.access_log import configure_logging
from servegate.gateway.reload import ConfigSource
from servegate.gateway.server import event_loop_factory, serve_until_stopped
from servegate.scaleout.settings import WorkerIdentity

ORPHAN_CHECK_S = 1.0


async def _serve(
    config: ServegateConfig, config_dir: Path | None, source: ConfigSource | None
) -> None:
    stop = asyncio.Event()
    parent = os.getppid()

    async def exit_when_orphaned() -> None:
        while True:
            await asyncio.sleep(ORPHAN_CHECK_S)
            if os.getppid() != parent:
                stop.set()
                return

    watch = asyncio.get_running_loop().create_task(exit_when_orphaned())
    try:
        await serve_until_stopped(config, config_dir, stop=stop, source=source, reuse_port=True)
    finally:
        watch.cancel()


def main() -> int:
    try:
        identity = WorkerIdentity.from_env()
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if identity is None:
        sys.stderr.write("error: a worker is started by `servegate serve --workers N`\n")
        return 2
    config = ServegateConfig.model_validate_json(Path(identity.config_path).read_bytes())
    configure_logging(config.log_level)
    # The gateway reloads on SIGHUP when it has a config file; without one a forwarded
    # SIGHUP must not kill the worker.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config_dir = Path(identity.config_dir) if identity.config_dir else None
    source = None
    if identity.config_file is not None:
        source = ConfigSource(Path(identity.config_file), identity.overrides)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_serve(config, config_dir, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
