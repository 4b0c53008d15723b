"""Sharded async checkpoints: short snapshot, background persist, verified load at any world size."""
