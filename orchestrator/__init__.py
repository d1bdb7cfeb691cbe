"""shardflow's core: the program format, settings, and the orchestrator that owns shards."""

from orchestrator.program import Program, ProgramError, parse_program
from orchestrator.runtime import connected
from orchestrator.service import Orchestrator
from orchestrator.settings import Settings

__all__ = ["Orchestrator", "Program", "ProgramError", "Settings", "connected", "parse_program"]
