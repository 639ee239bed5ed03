"""Token ids for routing, computed before the pure scheduler runs.

Tokenising can do I/O (a replica's `POST /tokenize`, discovering a model's folder
through `/v1/models`), so it lives here rather than in `scheduling/`, which stays
pure: `sources.py` (one source each), `auto.py` (learned per model from the
replicas) and `routing.py` (per model, which source; fills in the request's ids).
"""
