"""A vLLM-compatible model-server simulator: same API, metrics, KV cache and KV events.

Pure parts (`kv_cache`, `tokenizer`, `engine` scheduling) are importable without
starting anything; `SimServer` runs one server in the current event loop and
`servegate.testing.cluster.SimCluster` runs several for tests.
"""

from servegate.simulator.app import build_app
from servegate.simulator.config import SimConfig, SimConfigError, load_sim_config
from servegate.simulator.engine import Engine, SimRequest
from servegate.simulator.server import SimServer, run_servers

__all__ = [
    "Engine",
    "SimConfig",
    "SimConfigError",
    "SimRequest",
    "SimServer",
    "build_app",
    "load_sim_config",
    "run_servers",
]
