"""Prefix-cache awareness: which replica already holds a prompt's prefix in its KV cache."""
