"""Attention backends: how a step's queries meet the keys and values held in a KV cache."""
