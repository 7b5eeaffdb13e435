"""Serving: `Engine` (continuous batching over fixed cache slots) and, in `linnet_jax.serve.app`, the
OpenAI-compatible HTTP server on it (`linnet-jax serve`)."""

from linnet_jax.serve.engine import Engine, EngineFailed, Handle, Piece, QueueFull, Step

__all__ = ["Engine", "EngineFailed", "Handle", "Piece", "QueueFull", "Step"]
