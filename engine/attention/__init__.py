"""Paged attention backends, chosen by name (`attention: torch`); see backend.py for the contract."""
from engine.attention.backend import ATTENTION_BACKENDS, AttentionBackend, get_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "get_attention_backend"]
