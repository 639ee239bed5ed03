"""Latency- and SLO-aware routing: an online per-endpoint predictor and llm-d's plugins."""
