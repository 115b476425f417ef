"""Sparse MoE: routing (router.py) and expert execution behind a backend (backend.py, local.py)."""
from engine.moe.backend import MOE_BACKENDS, MoEBackend, make_moe_backend
from engine.moe.router import route_topk

__all__ = ["MOE_BACKENDS", "MoEBackend", "make_moe_backend", "route_topk"]
