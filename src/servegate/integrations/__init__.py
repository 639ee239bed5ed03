"""Glue that runs servegate inside other serving frameworks (Ray Serve, BentoML).

Nothing here imports those frameworks at import time: they are heavy, optional,
and installed only where they run (`make test-backends`, docs/backends.md).
"""
