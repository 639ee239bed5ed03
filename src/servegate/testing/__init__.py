"""Helpers for tests and benchmarks that users of servegate can use too."""
