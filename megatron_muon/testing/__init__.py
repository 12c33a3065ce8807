"""Test support: CPU-mode rank pool, per-test parallel layouts and tiny megatron models."""

from megatron_muon.testing.pool import RankPool, RemoteError, free_port

__all__ = ["RankPool", "RemoteError", "free_port"]
