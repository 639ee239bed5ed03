"""Endpoints and their live state: the datastore the scheduler reads."""

from servegate.pool.endpoint import (
    Endpoint,
    EndpointMetrics,
    EndpointState,
    LoraInfo,
    Role,
)
from servegate.pool.pool import Pool

__all__ = ["Endpoint", "EndpointMetrics", "EndpointState", "LoraInfo", "Pool", "Role"]
