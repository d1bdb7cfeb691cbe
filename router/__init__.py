"""The router: shard function, submit, status and wait."""

from router.client import Router, Submitted
from router.hashing import shard_for

__all__ = ["Router", "Submitted", "shard_for"]
