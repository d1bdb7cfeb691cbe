"""shardflow's core: the program format, settings, transport, state, and the shard owner."""

from orchestrator.connections import connected
from orchestrator.memory_store import MemoryStore
from orchestrator.owner import Orchestrator
from orchestrator.program import Program, ProgramError, parse_program
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import Store

__all__ = [
    "MemoryStore",
    "Orchestrator",
    "Program",
    "ProgramError",
    "RedisStore",
    "Settings",
    "Store",
    "connected",
    "parse_program",
]
