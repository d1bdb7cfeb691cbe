"""The one settings object, read from `SHARDFLOW_*` environment variables at the entrypoint."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import ConnectionPool
from redis.connection import parse_url
from redis.exceptions import RedisError

from orchestrator.program import PARALLEL, SERIAL, check_pool_name

# Shards a cluster may have; task messages name their owner shard within it.
MAX_SHARDS = 1024
# Named pools SHARDFLOW_POOLS may list.
MAX_POOLS = 256
_PREFIX = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


RESERVED = (
    "a '/', '?', '#', '[', ']' or '%' in its user or password must be percent-encoded "
    "(urllib.parse.quote(password, safe=''))"
)


def _split(url: str) -> SplitResult:
    """The URL's parts, or ValueError naming the fault, never a part of it."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # a '[...]' in the user or password read as an IPv6 host, quoted
        raise ValueError(RESERVED) from None
    # The host came after a password cut at a '/', '?' or '#': the netloc kept no '@', and
    # what follows has one. (After a netloc with its '@', an '@' in a vhost or option is fine.)
    if parts.netloc and "@" not in parts.netloc and "@" in url:
        raise ValueError(f"an '@' after its host: {RESERVED}, and an '@' in the vhost or an "
                         "option as %40")  # fmt: skip
    try:
        parts.port  # noqa: B018 (read to check it: 99999 or abc raise here, not at connect)
    except ValueError:
        raise ValueError(f"its port must be a number from 0 to 65535 ({RESERVED})") from None
    return parts


class Settings(BaseSettings):
    """Everything a shardflow process needs to know; built once and passed down."""

    # No NaN or infinity: `SHARDFLOW_GRACE_S=inf` would never stop, a NaN passes no bound.
    # Never the value in an error: a URL holds a password.
    model_config = SettingsConfigDict(
        env_prefix="SHARDFLOW_", extra="ignore", allow_inf_nan=False, hide_input_in_errors=True
    )

    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    redis_cluster: bool = False  # before the URL: its check reads it
    redis_url: str = "redis://127.0.0.1:6379/0"
    shards: int = Field(default=4, ge=1, le=MAX_SHARDS)
    prefix: str = "sf"
    queue_type: Literal["classic", "quorum"] = "classic"
    # A message that fails this often (a lost connection aside) is dead-lettered, on every
    # queue type; quorum queues also count redeliveries after a crash against it.
    delivery_limit: int = Field(default=20, ge=1)
    # Messages of each shard an orchestrator holds and handles at once: different programs'
    # side by side, each program's one at a time in delivery order (ordering.py); 1: strictly
    # one at a time.
    prefetch: int = Field(default=16, ge=1, le=1000)
    serial_concurrency: Literal[1] = 1
    parallel_concurrency: int = Field(default=16, ge=1, le=1000)
    # The most of a worker's slots one kind of program (one of a pool's shares, shares.py) may
    # hold, so a burst of one kind leaves the rest to others; 1: no reserve.
    fair_share: float = Field(default=0.75, gt=0, le=1)
    # A task message carries its step's args, so a program fits in a message (messages.py).
    max_program_bytes: int = Field(default=256 * 1024, ge=1024, le=8 * 1024 * 1024)
    max_output_bytes: int = Field(default=1024 * 1024, ge=64, le=64 * 1024 * 1024)
    # A step's whole output (a bag's: every member's) the owner will load; over it, the
    # program fails naming the step.
    max_join_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    # How long an ended program's keys stay in Redis (0: forever); `shardflow purge` for now.
    retention_s: float = Field(default=7 * 86400, ge=0, le=10 * 365 * 86400)
    # Members per task message, at most, of a bag or map that names no chunk while its pool's
    # queue or the owner's shard queues have a backlog (orchestrator/backlog.py), and programs'
    # single tasks per message while the pool's own queue has one (orchestrator/bundling.py);
    # 1: always one per message.
    auto_chunk: int = Field(default=10, ge=1, le=100)
    # Send the single tasks of several programs as one message while their pool's queue has a
    # backlog (orchestrator/bundling.py). Workers of a release before bundles park them: off
    # until every worker is upgraded.
    bundle_tasks: bool = True
    # Plans each owner keeps parsed (orchestrator/plans.py; also at most 64 MiB of them).
    plan_cache_size: int = Field(default=16384, ge=1)
    # Send the Redis commands of one event-loop turn as one pipeline (orchestrator/
    # pipelining.py); false: one round trip each. Not used with a Redis Cluster.
    redis_pipelining: bool = True
    # Connections to Redis a process opens at most; past them a command waits for one
    # (REDIS_POOL_WAIT_S) instead of opening more. 0: no bound. Not used with a Redis Cluster.
    redis_max_connections: int = Field(default=256, ge=0, le=100_000)
    # Send the AMQP frames of one event-loop turn as one write (orchestrator/coalescing.py);
    # false: one system call per frame, as aiormq does.
    amqp_coalescing: bool = True
    # A per-key limit's slot is a lease this long, renewed every third of it while its task
    # runs: a worker that dies holding one frees it at most this long after (lua/acquire.lua).
    key_lease_s: float = Field(default=30.0, ge=0.3, le=3600)
    grace_s: float = Field(default=10.0, ge=0, le=86400)
    # How long a starting orchestrator or worker waits for RabbitMQ and Redis.
    startup_wait_s: float = Field(default=120.0, ge=0, le=86400)
    wait_poll_s: float = Field(default=0.05, gt=0, le=60)
    # How often an orchestrator looks for programs recorded but never started (and starts them).
    sweep_s: float = Field(default=30.0, ge=0.1, le=86400)
    # /metrics, /livez, /healthz, /readyz of a long-running process (docs/observability.md); 0: off.
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    metrics_addr: str = "0.0.0.0"
    log_format: Literal["text", "json"] = "text"
    # The named pools programs may use besides serial and parallel, comma-separated; empty:
    # any name (a misspelled one waits for a worker that never comes, leaving its queues).
    pools: str = ""

    # No message below quotes a part of a URL: a password with a reserved character left as
    # it is splits there, and its pieces would read as the port, the path or the query.

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        parts = _split(value)
        if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
            raise ValueError("must be an amqp:// or amqps:// URL with a host")
        if parts.fragment:
            raise ValueError("has a '#' part, which no option reads (a '#' in a password?)")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str, info: ValidationInfo) -> str:
        parts = _split(value)
        # redis-py ignores a database that is not a number (`/abc`) and uses 0: refuse it.
        if parts.scheme in ("redis", "rediss") and not re.fullmatch(r"/?|/\d{1,5}", parts.path):
            raise ValueError("its path must be a database number, e.g. /0")
        if info.data.get("redis_cluster"):  # its client takes options of its own
            try:
                parse_url(value)
            except ValueError as exc:  # it quotes an option's name
                raise ValueError(str(exc)) from None
            return value
        try:
            # Builds a connection without connecting: an option of no connection (a TLS one on
            # redis://, a typo) failed only at the first command, as a traceback.
            ConnectionPool.from_url(value).make_connection()
        except TypeError as exc:
            option = re.search(r"argument '(\w{1,40})'", str(exc))
            name = repr(option.group(1)) if option else "an option"
            tls = " (TLS ones need rediss://)" if name.startswith("'ssl") else ""
            raise ValueError(f"{name} is no option of Redis's{tls}") from None
        except (ValueError, RedisError) as exc:  # they quote an option's name, or its value
            raise ValueError(str(exc)) from None
        return value

    @field_validator("pools")
    @classmethod
    def _pools_are_names(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        if len(names) > MAX_POOLS:
            raise ValueError(f"{len(names)} pools, over {MAX_POOLS}")
        return ",".join(check_pool_name(name) for name in dict.fromkeys(names))

    @property
    def allowed_pools(self) -> frozenset[str] | None:
        """The pools programs may use (SHARDFLOW_POOLS, serial and parallel); None: any."""
        if not self.pools:
            return None
        return frozenset([SERIAL, PARALLEL, *self.pools.split(",")])

    @field_validator("prefix")
    @classmethod
    def _prefix_is_a_name(cls, value: str) -> str:
        if not _PREFIX.match(value):
            raise ValueError("must be 1-32 of a-z, 0-9, '_' or '-', starting with a letter")
        return value


def redis_place(settings: Settings) -> str:
    """Where SHARDFLOW_REDIS_URL points, as the Redis client reads it (a `?db=` wins over the
    path): host, port and database, or a socket's path; never the URL, which may hold a
    password."""
    options = parse_url(settings.redis_url)
    if "path" in options:  # unix://
        where = str(options["path"])
    else:
        host = str(options.get("host", "localhost"))
        where = f"[{host}]" if ":" in host else host
        where += f":{options.get('port', 6379)}"
    if settings.redis_cluster:
        return f"Cluster {where}"
    return f"{where}/{options.get('db', 0)}"


# SHARDFLOW_* names read outside Settings: the CLI's log level, and this repository's test,
# benchmark and packaging scripts (and, by prefix, their families).
OTHER_VARIABLES = frozenset(
    {
        "SHARDFLOW_LOG_LEVEL",
        "SHARDFLOW_FUZZ_EXAMPLES",
        "SHARDFLOW_BASE_IMAGE",
        "SHARDFLOW_HELM",
        "SHARDFLOW_PODMAN_NO_INSTALL",
        "SHARDFLOW_TIMELINE_OUT",
    }
)
OTHER_PREFIXES = ("SHARDFLOW_TEST_", "SHARDFLOW_FAULT_")
MAX_UNKNOWN_SAID = 5  # names warned of, at most: the environment is anyone's
# What Kubernetes puts in a pod's environment for a Service named `shardflow-...` (its
# service links, unless the pod turns them off as the chart's do): no typo of ours.
# `<NAME>_PORT` alone only with a link's value: `SHARDFLOW_METRIC_PORT=9000` is a typo.
_SERVICE_LINK = re.compile(r"SHARDFLOW_\w*_(SERVICE_(HOST|PORT\w*)|PORT_\d+_(TCP|UDP|SCTP)\w*)")
_LINK_PORT = re.compile(r"SHARDFLOW_\w*_PORT")
_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://\S{1,200}")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each SHARDFLOW_* name no setting reads (a typo leaves its setting at the
    default: `SHARDFLOW_PREFX` keeps prefix `sf`, another cluster's), with the nearest name."""
    known = [f"SHARDFLOW_{name.upper()}" for name in Settings.model_fields]
    close_to = [*known, *sorted(OTHER_VARIABLES)]
    said: list[str] = []
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings reads names case-insensitively
        if not upper.startswith("SHARDFLOW_") or upper in known:
            continue
        if upper in OTHER_VARIABLES or upper.startswith(OTHER_PREFIXES):
            continue
        if _SERVICE_LINK.fullmatch(upper[:200]) or (
            _LINK_PORT.fullmatch(upper[:200]) and _LINK_VALUE.fullmatch(environ[name][:210])
        ):
            continue
        if len(said) == MAX_UNKNOWN_SAID:
            said.append("and more SHARDFLOW_* variables that no setting reads")
            break
        shown = ascii(name[:60])[1:-1]
        close = difflib.get_close_matches(upper[:60], close_to, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        said.append(f"{shown} is no setting{hint}: ignored")
    return said
