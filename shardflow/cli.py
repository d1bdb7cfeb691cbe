"""The `shardflow` command. Signals are handled here and nowhere else."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import difflib
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import traceback
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import uvloop
from pydantic import ValidationError
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import InvalidResponse as RedisInvalidResponse
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import ResponseError as RedisResponseError

from orchestrator import logs
from orchestrator.bus import MAX_DEAD_HELD, AccessRefused, Bus, TopologyError
from orchestrator.connections import (
    UNREACHABLE,
    connected,
    connected_bus,
    redis_refusal,
    refused_login,
)
from orchestrator.delivery import (
    describe,
    first_error,
    redis_refuses,
)
from orchestrator.documents import parse_document, parse_input
from orchestrator.health import serving
from orchestrator.keys import check_workflow_id
from orchestrator.lifecycle import end_tasks, within
from orchestrator.loopwatch import watched
from orchestrator.owner import Orchestrator, ShardError
from orchestrator.program import (
    MAX_PRIORITY,
    MAX_SIGNAL_BYTES,
    ProgramError,
    check_pool_name,
    program_schema,
)
from orchestrator.redis_store import RedisStore
from orchestrator.settings import MAX_SHARDS, Settings, redis_place, unknown_variables
from orchestrator.store import TERMINAL, Store
from router.client import NoProgram, Router, Submitted
from router.dead_letters import death_reason, parked_at, parked_before, sent_back
from router.explain import explain_text
from router.hashing import shard_for
from router.ingress import Ingress
from router.listing import DEFAULT_LIMIT, SCAN_MAX, STATUSES, ListError, clean, parse_duration
from router.redriving import RedriveError
from router.retention import purge
from shardflow.dev import Dev, Together, workers
from shardflow.views import LiveProgress, list_table
from worker.pool import Worker
from worker.registry import Registry
from worker.threads import left_running

T = TypeVar("T")

EXIT_FAILED = 1  # the program ended failed or cancelled
EXIT_USAGE = 2  # bad arguments, program or input
EXIT_TIMEOUT = 3  # --wait gave up; the program goes on
EXIT_UNAVAILABLE = 4  # RabbitMQ or Redis could not be reached

LONG_RUNNING = ("dev", "orchestrator", "router", "worker")
log = logging.getLogger(__name__)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_CONCURRENCY = 1000  # as SHARDFLOW_PARALLEL_CONCURRENCY
MAX_DEAD = 1000  # `dead` holds what it lists in memory
DEAD_LISTED = 100  # `dead` lists this many unless told
MAX_DEAD_PURGE = 100_000  # `dead --purge --older-than` takes them one at a time: a run's worth
MAX_WAIT_S = 10 * 365 * 86400.0


class _StdoutClosed(Exception):
    """Whoever read standard output stopped reading (`shardflow schema | head -1`)."""


class CliError(Exception):
    """A one-line error for the user, and the exit code to leave with."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


MAX_HINTED = 5  # unrecognized arguments given a suggestion, at most

# Every command's help ends with them (the README's table says the same).
EXIT_CODES = (
    "Exit codes: 0 done; 1 the program failed (submit --wait), or no such program; 2 bad "
    "arguments, program, input or settings, or a login or name that RabbitMQ or Redis "
    "refuses (one line naming the fault); 3 --wait timed out (the program goes on); 4 "
    "RabbitMQ or Redis could not be reached; 130 interrupted (Ctrl-C); 141 stdout was closed."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="A sharded workflow orchestrator on RabbitMQ and Redis. Connections, shard "
        "count and names come from SHARDFLOW_* environment variables (SHARDFLOW_AMQP_URL, "
        "SHARDFLOW_REDIS_URL, SHARDFLOW_SHARDS, SHARDFLOW_PREFIX, ...).",
        epilog=EXIT_CODES,
    )
    _log_level_argument(parser, os.environ.get("SHARDFLOW_LOG_LEVEL") or None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    about = "run every shard and both worker pools in one process (until Ctrl-C)"
    dev = commands.add_parser("dev", help=about, description=about[0].upper() + about[1:] + ".")
    dev.add_argument(
        "--shards",
        type=_shard_count,
        metavar="N",
        help=f"shard count, 1 to {MAX_SHARDS} (default: SHARDFLOW_SHARDS, else 4), of this "
        "process only: submit and the router place programs by their own SHARDFLOW_SHARDS, so "
        "set that instead to change it for all",
    )
    _app_argument(dev, "import MODULE and use its @task() handlers")
    _concurrency_argument(dev, "the parallel pool's and named pools' tasks at once")
    dev.add_argument(
        "--pool",
        action="append",
        default=[],
        type=_pool_list,
        metavar="NAME[,NAME...]",
        help="also run workers for these named pools (repeatable)",
    )

    orch = commands.add_parser(
        "orchestrator",
        help="consume some shards' queues",
        description="Consume these shards' queues and decide their programs' steps, until "
        "SIGINT or SIGTERM. Each shard is owned by one consumer at a time: run two processes "
        "per shard, and the second is a hot standby that RabbitMQ promotes when the first "
        "goes away. Every shard of 0..SHARDFLOW_SHARDS-1 needs one.",
    )
    orch.add_argument(
        "--shards",
        required=True,
        type=_shard_list,
        metavar="0,1,...",
        help=f"which shards to own, e.g. 0,1 (numbers from 0 to {MAX_SHARDS - 1})",
    )

    router = commands.add_parser(
        "router",
        help="submit the programs that arrive on the ingress queue",
        description="Submit the programs that arrive as messages on the ingress queue "
        "(<prefix>.ingress), and the signals sent there, until SIGINT or SIGTERM: each "
        "program is checked, recorded and started on its shard; a request refused is parked "
        "with its reason, and one naming a reply queue gets the answer there.",
    )
    _app_argument(router, "refuse programs naming tasks that MODULE does not define")

    work = commands.add_parser(
        "worker",
        help="run tasks from one pool (or a few)",
        description="Run the @task() handlers of --app for the tasks of one pool or a few, "
        "until SIGINT or SIGTERM (running tasks get SHARDFLOW_GRACE_S to end, then go back "
        "to their queue). The serial pool and every lane (serial-NAME) run one task at a "
        "time in the whole cluster: a second worker of one is a standby.",
    )
    work.add_argument(
        "--pool",
        action="append",
        required=True,
        type=_pool_list,
        metavar="NAME[,NAME...]",
        help="serial, parallel, or a named pool (1-40 of a-z 0-9 _ -); repeatable or "
        "comma-separated: one worker per pool in this process",
    )
    _app_argument(work, "import MODULE and use its @task() handlers", required=True)
    _concurrency_argument(
        work,
        "task messages at once, per pool (not the serial pool or a lane: one); a chunked bag "
        "message counts once",
    )

    for long_running in (dev, orch, router, work):
        _metrics_argument(long_running)

    submit = commands.add_parser(
        "submit",
        help="submit a program; prints its workflow id",
        description="Submit a program (its JSON from a file, or '-' for stdin): it is checked, "
        "recorded and started on its shard. Prints its workflow id; with --wait, waits for "
        "its end and prints its result (the id on stderr), exit 1 when it did not complete. "
        "The same --id with the same program and input is the same program, not a second.",
    )
    submit.add_argument("program", type=Path, help="program JSON file ('-' for stdin)")
    submit.add_argument(
        "--input", default="null", metavar="JSON", help="the program's input, as JSON (null)"
    )
    submit.add_argument("--id", help="workflow id (default: a new random id)")
    submit.add_argument(
        "--priority",
        type=int,
        default=0,
        choices=range(MAX_PRIORITY + 1),
        metavar=f"0-{MAX_PRIORITY}",
        help="higher goes first: its tasks go before lower ones' in each pool (default 0)",
    )
    submit.add_argument(
        "--wait", action="store_true", help="wait for the end; print the result JSON"
    )
    submit.add_argument(
        "--timeout",
        type=_seconds,
        metavar="S",
        help="with --wait: give up after S seconds, exit 3; the program goes on "
        "(default: wait as long as it takes)",
    )
    _app_argument(submit, "check task names against the @task()s of MODULE")

    status = commands.add_parser(
        "status",
        help="print a program's status as JSON",
        description="Print a program's status as JSON: its status, name, owner shard, step "
        "cursor, result or error, times, failed attempts and, when redriven, how each run "
        "ended. Exit 0 whatever the program's status (a failed one's too); 1 when there is no "
        "such program. `explain` says the same in words, and what it waits for.",
    )
    _id_argument(status)
    _inspection_commands(commands)

    signal = commands.add_parser(
        "signal",
        help="send a signal to a program's signal step; prints what became of it",
        description='Send a signal to a program: its step {"signal": NAME} waiting now takes '
        "it, or the next such step will (signals of one name are taken in the order sent). The "
        "step's output is the signal's data. Refused, with the reason, for a program that has "
        "ended or has no signal step of that name.",
    )
    signal.add_argument("id", help="the workflow id")
    signal.add_argument("name", help="the signal's name, as its step names it")
    signal.add_argument(
        "--data", default="null", metavar="JSON", help="the signal's data, as JSON (64 KiB)"
    )
    signal.add_argument(
        "--signal-id",
        metavar="SID",
        help="an id for this signal: sending the same id again is no second signal (for retries)",
    )

    about = (
        "cancel a program: no further step runs, running tasks are stopped (but those of a "
        "step that names compensations, which run to their end)"
    )
    cancel = commands.add_parser(
        "cancel",
        help=about,
        description=about[0].upper() + about[1:] + ". A program whose steps name "
        "compensations turns compensating, and undoes what completed. Prints the program's "
        "status as JSON, and a note on stderr when nothing changed (it had ended: the first "
        "end stands; or it compensates already). Exit 1 when there is no such program.",
    )
    _id_argument(cancel)
    cancel.add_argument(
        "--reason", default="cancelled", metavar="TEXT", help="recorded as the program's error"
    )
    cancel.add_argument(
        "--stop-compensations",
        action="store_true",
        help="of a compensating program (a plain cancel changes nothing then): stop its "
        "compensations, ending it compensation_failed with the reason",
    )

    redrive = commands.add_parser(
        "redrive",
        help="run a failed or cancelled program again from the step it stopped at",
        description="Run a failed or cancelled program again from the step it stopped at "
        "(its failed step; for a cancelled one, the step it was running), keeping the "
        "outputs of the steps before it. Messages of the earlier run are refused as stale; "
        "`status` keeps how each run ended (`runs`). A running or completed program is "
        "refused (exit 2), an unknown one too (exit 1). Prints the status as JSON.",
    )
    _id_argument(redrive)
    redrive.add_argument(
        "--from",
        dest="from_step",
        metavar="STEP",
        help="run again from this top-level step number instead (at most the one it stopped "
        "in; every step from there on runs again); the step before it must be a task, a bag, "
        "a map, a sleep or a signal",
    )

    purge = commands.add_parser(
        "purge",
        help="delete ended programs now; never a live one",
        description="Delete ended programs now, with every key they own; never a live one. "
        "Ended programs expire by themselves after SHARDFLOW_RETENTION_S (default 7 days). "
        "What a program that ended moments ago still has in flight (a retry waiting, the "
        "report of a task still running) is dead-lettered as 'no such program' once it is "
        "purged: --older-than 10m leaves those. "
        'Prints the counts as JSON: {"purged", "live", "kept", "missing"}: purged; live '
        "(not ended, never touched); kept (ended, but not so, or not that long ago, as "
        "--status and --older-than ask); missing (gone meanwhile: expired, or purged by "
        "another).",
    )
    purge.add_argument(
        "--status",
        action="append",
        choices=sorted(TERMINAL),
        help="only programs that ended so (repeatable; default: every ended program)",
    )
    purge.add_argument(
        "--older-than",
        type=_duration,
        default=0.0,
        metavar="DURATION",
        help="only programs that ended at least this long ago, e.g. 90s, 30m, 12h, 7d",
    )

    dead = commands.add_parser(
        "dead",
        help="list dead-lettered messages with the reason each was refused (or delete them, "
        "or send them back)",
        description="List the dead-lettered messages, oldest first, one JSON line each: why it "
        "was refused, the queue it came from, when it was parked (`at`, ms; null when not "
        "known) and its body (its first 500 characters; one that is no UTF-8 also as "
        "`body_base64`, its first 500 bytes). They stay in the queue. With --purge, delete "
        "them instead; with --requeue, publish them again to the queues they came from.",
    )
    dead.add_argument(
        "--limit",
        type=_bounded(1, MAX_DEAD_PURGE),
        metavar="N",
        help=f"at most N, the oldest: listed, 1 to {MAX_DEAD} (default {DEAD_LISTED}; they "
        f"stay in the queue); with --purge, deleted; with --requeue, looked at (sent back, "
        f"or kept); 1 to {MAX_DEAD_PURGE:,} (default: all; with --requeue or --older-than, "
        f"at most {MAX_DEAD_PURGE:,} a run)",
    )
    dead.add_argument(
        "--purge",
        action="store_true",
        help="delete dead-lettered messages (all of them, or with --older-than the older "
        "ones) and print how many were deleted and how many are left",
    )
    dead.add_argument(
        "--requeue",
        action="store_true",
        help=f"publish dead-lettered messages again to the queue each came from (this "
        f"cluster's shard, pool and ingress queues only), oldest first: those there when "
        f"it began, at most {MAX_DEAD_PURGE:,} (it stops at {MAX_DEAD_HELD:,} kept), and "
        "print how many went, how many were kept (no such queue known, left in place) and "
        "how many are left. Safe for any of them: every transition is compare-and-advance, "
        "so one that already happened changes nothing; one refused again comes back here, "
        "behind the rest, and is not sent again in the same run. For what a fault since "
        "mended parked (Redis full, a bug)",
    )
    dead.add_argument(
        "--older-than",
        type=_duration,
        metavar="DURATION",
        help=f"with --purge: only those parked at least this long ago, e.g. 12h, 7d, at most "
        f"{MAX_DEAD_PURGE:,} a run (one whose time is not known counts as old: it was parked "
        "before those after it; so does one stamped over 5 minutes ahead, by a node whose "
        "clock was ahead)",
    )

    about = (
        "each shard's queue depth, consumers, programs in flight, and whether it is in "
        "the ring or draining"
    )
    commands.add_parser(
        "shards",
        help=about,
        description=f"Print, one JSON line per shard, {about}: shards from SHARDFLOW_SHARDS on "
        "that still hold work are draining, and removable once empty.",
    )

    about = "print the program format's JSON Schema"
    commands.add_parser(
        "schema",
        help=about,
        description=about[0].upper() + about[1:] + ", for an editor or a check of "
        "programs before they are submitted.",
    )
    for command in commands.choices.values():  # after the command too, as people type it
        _log_level_argument(command, argparse.SUPPRESS)
        command.epilog = EXIT_CODES
    return parser


def _log_level_argument(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=default,
        metavar="LEVEL",
        help=f"{', '.join(level.lower() for level in LOG_LEVELS)} "
        "(default: SHARDFLOW_LOG_LEVEL, else info for dev, orchestrator, worker and router, "
        "warning for the rest)",
    )


def _id_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="the workflow id, as `submit` printed it")


def _concurrency_argument(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--concurrency",
        type=_bounded(1, MAX_CONCURRENCY),
        metavar="K",
        help=f"{help}, 1 to {MAX_CONCURRENCY} (default: SHARDFLOW_PARALLEL_CONCURRENCY, else 16)",
    )


def _bounded(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def number(text: str) -> int:
        if not text.strip().isdigit() or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: a number from {low} to {high}")
        return int(text)

    return number


def _shard_count(text: str) -> int:
    return _bounded(1, MAX_SHARDS)(text)


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} (or SHARDFLOW_LOG_LEVEL): one of "
            + ", ".join(level.lower() for level in LOG_LEVELS)
        )
    return text.upper()


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WAIT_S:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r}: seconds, more than 0 (at most ten years)")
    return seconds


def _app_argument(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    parser.add_argument(
        "--app",
        action="append",
        default=[],
        required=required,
        metavar="MODULE",
        help=f"{help} (repeatable)",
    )


def _metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="P",
        help="serve /metrics, /livez, /healthz, /readyz on this port; 0: none "
        "(default: SHARDFLOW_METRICS_PORT, else 9464)",
    )


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port from 0 to 65535")
    return int(text)


def _inspection_commands(commands: Any) -> None:
    listing = commands.add_parser(
        "list",
        help="programs newest first, filtered",
        description="Programs newest first (by when they were recorded: programs submitted "
        "side by side may differ from `created_ms` by a few milliseconds), filtered by status, "
        "name and age: a table, or with --json one object per line (its `cursor` is the "
        "program's step). When there are more, the next page's cursor is printed on stderr: "
        "pass it as --before.",
    )
    listing.add_argument(
        "--status",
        action="append",
        default=[],
        choices=STATUSES,
        help="only programs in this status (repeatable: any of them)",
    )
    listing.add_argument("--name", help="only programs of this name")
    listing.add_argument(
        "--since", type=_duration, metavar="DURATION", help="created in the last 90s, 15m, 2h, 7d"
    )
    listing.add_argument(
        "--limit", type=_limit, default=DEFAULT_LIMIT, metavar="N", help="at most N (50)"
    )
    listing.add_argument("--before", metavar="CURSOR", help="the next page, as printed on stderr")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    explain = commands.add_parser(
        "explain",
        help="where a program stands and what it waits for, in plain words",
        description="Where a program stands and what it waits for, in plain words: its step, "
        "the tasks it waits for and why (a retry's time, a slot of a key, the serial lane, a "
        "pool no worker consumes, a signal, a timer), its owner shard, its deadline, failed "
        "attempts and compensations. With --json, the same facts as JSON. Exit 1 when there "
        "is no such program.",
    )
    _id_argument(explain)
    explain.add_argument("--json", action="store_true", help="the same facts as JSON")


def _utf8(body: bytes) -> bool:
    try:
        body.decode()
    except UnicodeDecodeError:
        return False
    return True


def _before(text: str | None) -> str | None:
    if text == "":  # no cursor of a listing is empty: a script's unset variable, say
        raise CliError("--before: empty; pass the cursor a listing printed, or leave it out")
    return text


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ListError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limit(text: str) -> int:
    return _bounded(1, SCAN_MAX)(text)


def _shard_list(text: str) -> list[int]:
    try:
        shards = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of numbers") from None
    if not shards:
        raise argparse.ArgumentTypeError("name at least one shard")
    if not 0 <= shards[0] <= shards[-1] < MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"{text!r}: shard numbers are 0 to {MAX_SHARDS - 1}")
    return shards


def _pool_list(text: str) -> list[str]:
    pools = [part.strip() for part in text.split(",") if part.strip()]
    if not pools:
        raise argparse.ArgumentTypeError("name at least one pool")
    try:
        return [check_pool_name(pool) for pool in pools]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pools(groups: list[list[str]]) -> list[str]:
    """`--pool a,b --pool c`: every pool named, once each, in order."""
    return list(dict.fromkeys(pool for group in groups for pool in group))


def _unrecognized(
    parser: argparse.ArgumentParser, command: str | None, extras: list[str]
) -> NoReturn:
    """Exit 2 naming the arguments `command` (None: shardflow itself, given them before the
    command) does not take, and the option each resembles."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = parser if command is None else commands.choices[command]
    options = [name for action in sub._actions for name in action.option_strings]
    hints = []
    for extra in extras[:MAX_HINTED]:
        given = extra.split("=", 1)[0][:40]
        close = difflib.get_close_matches(given, options, n=1, cutoff=0.7)
        if given.startswith("-") and close:
            hints.append(f"{clean(given, 40)}: did you mean {close[0]}?")
    said = clean(" ".join(extras), 200)  # a terminal's input: escaped, as any echo of it
    sub.error(f"unrecognized arguments: {said}" + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point of the `shardflow` console script."""
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # said by the command's own parser, with its usage: argparse says the top's
        tokens = sys.argv[1:] if argv is None else argv
        before = tokens[: tokens.index(args.command)] if args.command in tokens else []
        _unrecognized(parser, None if set(extras) & set(before) else args.command, extras)
    # A short command's own progress (`ended cancelled: ...`) is no news beside its output.
    level = args.log_level or ("INFO" if args.command in LONG_RUNNING else "WARNING")
    logs.configure(level, os.environ.get("SHARDFLOW_LOG_FORMAT", "text"))
    if args.command not in LONG_RUNNING:
        # A command's connection fault is its one line; aiormq's and aio-pika's own logs
        # of it (an error, "reconnecting") would only repeat it.
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    for line in unknown_variables(os.environ):  # a typo would leave its setting's default
        if args.command in LONG_RUNNING:
            log.warning("%s", line)
        else:
            print(f"shardflow: warning: {line}", file=sys.stderr)
    try:
        _check_text(args)
        overrides: dict[str, Any] = {}
        if getattr(args, "shards", None) is not None and args.command == "dev":
            overrides["shards"] = args.shards
        if getattr(args, "metrics_port", None) is not None:
            overrides["metrics_port"] = args.metrics_port
        settings = Settings(**overrides)  # validated as the environment's values are
        if args.command == "submit" and args.timeout is not None and not args.wait:
            print("shardflow: --timeout has no effect without --wait", file=sys.stderr)
        code = uvloop.run(_COMMANDS[args.command](settings, args))
    except ValidationError as exc:
        code = _fail(f"settings: {_settings_fault(exc)}", EXIT_USAGE)
    except CliError as exc:
        code = _fail(str(exc), exc.code)
    except ProgramError as exc:
        code = _fail(str(exc), EXIT_USAGE)
    except (TopologyError, AccessRefused) as exc:  # the configuration's: waiting cannot mend it
        code = _fail(str(exc), EXIT_USAGE)
    except RedisAuthenticationError as exc:  # a command of Redis alone (list, status, ...)
        code = _fail(str(redis_refusal(settings.redis_url, exc)), EXIT_USAGE)
    except UNREACHABLE as exc:
        code = _fail(f"cannot connect to {_service(exc)}: {exc}", EXIT_UNAVAILABLE)
    except RedisClusterException as exc:  # a fault of the cluster's configuration
        if (refused := refused_login(exc)) is not None:
            code = _fail(str(redis_refusal(settings.redis_url, refused)), EXIT_USAGE)
        else:
            code = _fail(f"Redis Cluster (SHARDFLOW_REDIS_URL): {exc}", EXIT_UNAVAILABLE)
    except RedisInvalidResponse as exc:
        code = _fail(f"cannot connect to {_service(exc)}: not Redis? {exc}", EXIT_UNAVAILABLE)
    except RedisResponseError as exc:
        if redis_refuses(exc) or isinstance(exc, RedisReadOnlyError):  # full, say: wait
            refusal = f"{type(exc).__name__}: {describe(exc)}"
            code = _fail(f"{_service(exc)} refuses work now ({refusal})", EXIT_UNAVAILABLE)
        elif "DB index" not in str(exc):  # anything else is not the configuration's fault
            raise
        else:
            code = _fail(f"cannot connect to {_service(exc)}: {exc}", EXIT_UNAVAILABLE)
    except KeyboardInterrupt:
        code = 130
    except _StdoutClosed:
        # Quietly, with the status of a command killed by SIGPIPE (141), as commands in a
        # pipe do. Python would flush stdout again at exit and report the broken pipe:
        # point it at /dev/null first (the Python docs' note on SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    sys.exit(code)


def _check_text(args: argparse.Namespace) -> None:
    """Refuse arguments that are not text: the shell passes any bytes, Python turns the ones
    that are not UTF-8 into lone surrogates, which nothing downstream can encode."""
    for name, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                bad = exc.object[exc.start : exc.end]
                raise CliError(f"{name}: not UTF-8 text (a lone surrogate {bad!r})") from None


def _fail(message: str, code: int) -> int:
    print(f"shardflow: {message}", file=sys.stderr)
    return code


def _print(text: str) -> None:
    """One line (or document) to stdout, now; a reader that went away is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:  # an OSError: without this, UNREACHABLE says "cannot connect"
        raise _StdoutClosed from None
    except OSError as exc:  # a full disk, say: not a connection's fault
        raise CliError(f"cannot write to stdout: {exc.strerror or exc}", EXIT_FAILED) from None


def _service(exc: BaseException) -> str:
    """Which service a connection fault is of, and the variable that says where it is (never
    the URL itself: it may hold a password)."""
    if isinstance(exc, RedisError | RedisClusterException):
        return "Redis (SHARDFLOW_REDIS_URL)"
    return "RabbitMQ (SHARDFLOW_AMQP_URL)"


def _settings_fault(exc: ValidationError) -> str:
    return first_error(exc, lambda loc: "SHARDFLOW_" + "_".join(map(str, loc)).upper())


# What still runs once a service stopped is waited for this long: its handlers were cancelled
# and waited for already, and the chart's pod has grace_s + 10 s in all.
END_REST_S = 1.0


async def _serve(make: Callable[..., Any], settings: Settings, name: str) -> int:
    """Build a service on fresh connections and run it until SIGINT/SIGTERM."""

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    # Until the service runs, a signal just cancels the start (e.g. waiting for RabbitMQ).
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    try:
        async with connected(settings, name, wait_s=settings.startup_wait_s) as (store, bus):
            for fault in await store.durability_faults():
                logging.getLogger(name).warning("%s", fault)
            service = make(store, bus)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, service.shutdown)
            async with serving(settings, store, bus, service), watched(name):
                await service.run()
    except asyncio.CancelledError:
        logging.getLogger(name).info("stopped before it started")
    finally:
        failing = sys.exc_info()[1] is not None
        await end_the_rest(name, code=EXIT_FAILED if failing else 0)
    return 0


async def end_the_rest(
    name: str,
    within_s: float = END_REST_S,
    leave: Callable[[int], Any] = os._exit,
    code: int = 0,
) -> None:
    """Cancel what still runs once the service stopped (handlers were cancelled and waited
    for already). A task that refuses its cancel (a handler that catches it), or a plain
    function's thread still running, would hold the process at its exit for good, as the
    event loop waits for every task and Python for every pool thread: the process leaves
    at once then, with `code`."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    ended = await end_tasks(rest, f"{name}: a task", within_s)
    threads = left_running()
    if ended and not threads:
        return
    logging.getLogger(name).error(
        "%s: %d task(s) refuse to end (a handler that catches its cancel) and %d handler "
        "thread(s) still run; exiting now",
        name,
        sum(not task.done() for task in rest),
        threads,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    leave(code)


def _registry(modules: list[str]) -> Registry:

    sys.path.insert(0, os.getcwd())
    for module in modules:  # one at a time: an error names the one that failed
        _import_app(module)
    try:
        registry = Registry.from_modules(modules)
    except ValueError as exc:  # two modules' handlers of one name
        raise CliError(f"--app: {exc}") from None
    if modules and not registry.names():  # a worker that knows nothing fails every task
        raise CliError(
            f"--app {', '.join(modules)}: no @task() handler in it (decorate its functions "
            "with worker.task; a handler imported from another module counts too)"
        )
    return registry


def _import_app(module: str) -> None:
    """Import an --app module, or CliError naming it, and where it failed if inside it."""
    if "/" in module or (module.endswith(".py") and not _importable(module)):
        if module.startswith("/"):
            raise CliError(
                f"--app {module}: a module's name, not a file's: put its folder on PYTHONPATH "
                "and name the module"
            )
        dotted = module.removesuffix(".py").replace("/", ".").strip(".")
        raise CliError(f"--app {module}: a module's name, not a file's: --app {dotted}")
    if ":" in module:  # uvicorn's and Celery's `module:app`: every @task() of it is found
        raise CliError(
            f"--app {module}: a module's name, without ':' (its @task() functions are found "
            f"in it): --app {module.partition(':')[0]}"
        )
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if exc.name is None or not (module + ".").startswith(exc.name + "."):
            raise CliError(f"--app {module}: importing it raised {_where(exc)}: {exc}") from None
        raise CliError(f"--app {module}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the module failed: a syntax error, a sys.exit()
        said = f": {exc}" if str(exc) else ""
        raise CliError(f"--app {module}: importing it raised {_where(exc)}{said}") from None


def _importable(module: str) -> bool:
    """Whether `module` names a module (`pkg.py` may be a package's submodule `py`)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its package is none
        return False


def _where(exc: BaseException) -> str:
    """The exception's type, and where it was raised (the innermost frame, or a syntax
    error's own place)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{type(exc).__name__} at {exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    return f"{type(exc).__name__} at {frames[-1].filename}:{frames[-1].lineno}"


async def _dev(settings: Settings, args: argparse.Namespace) -> int:

    registry = _registry(args.app)
    if not args.app:
        log.warning("dev: no --app given: no task handler is known, so every task fails")
    return await _serve(
        lambda store, bus: Dev(
            settings,
            registry,
            store=store,
            bus=bus,
            concurrency=args.concurrency,
            pools=_pools(args.pool),
        ),
        settings,
        "shardflow-dev",
    )


async def _orchestrator(settings: Settings, args: argparse.Namespace) -> int:

    try:
        return await _serve(
            lambda store, bus: Orchestrator(settings, args.shards, store=store, bus=bus),
            settings,
            f"shardflow-orchestrator-{','.join(map(str, args.shards))}",
        )
    except ShardError as exc:
        raise CliError(f"--shards: {exc}") from None


async def _router(settings: Settings, args: argparse.Namespace) -> int:

    known = _registry(args.app).names() if args.app else None
    return await _serve(
        lambda store, bus: Ingress(
            settings, Router(settings, store=store, bus=bus, known_tasks=known), bus
        ),
        settings,
        "shardflow-router",
    )


async def _worker(settings: Settings, args: argparse.Namespace) -> int:

    registry = _registry(args.app)
    pools = _pools(args.pool)

    def make(store: RedisStore, bus: Bus) -> Worker | Together:
        parts = workers(
            settings, registry, pools, store=store, bus=bus, concurrency=args.concurrency
        )
        return parts[0] if len(parts) == 1 else Together(parts)

    return await _serve(make, settings, f"shardflow-worker-{','.join(pools)}")


async def _submit(settings: Settings, args: argparse.Namespace) -> int:

    text = _read_program(args.program, settings.max_program_bytes)
    payload = parse_input(args.input, max_bytes=settings.max_program_bytes)
    known = _registry(args.app).names() if args.app else None
    async with connected(settings, "shardflow-submit") as (store, bus):
        router = Router(settings, store=store, bus=bus, known_tasks=known)
        wf = args.id if args.id is not None else uuid.uuid4().hex  # said, whatever happens
        try:
            submitted = await _broker_bound(router.submit(text, payload, wf, args.priority))
        except _BrokerSlow:
            if not await store.state(wf):
                raise CliError(f"{BROKER_SLOW}; nothing was recorded", EXIT_UNAVAILABLE) from None
            # Recorded: its owner's sweep starts it if the start message never goes.
            print(f"shardflow: {BROKER_SLOW}; {wf} is recorded, and starts once RabbitMQ takes "
                  "its start (or the owner's sweep starts it)", file=sys.stderr)  # fmt: skip
            submitted = Submitted(wf, shard_for(wf, settings.shards), False, "pending")
        else:  # not after a slow broker: the program was recorded, by this submit or before
            if not args.wait:  # with --wait, the program's outcome says it
                _say_not_created(submitted)
        if not args.wait:
            _print(submitted.workflow_id)
            return 0
        print(submitted.workflow_id, file=sys.stderr)
        # Before a short --timeout runs out too: a script's wait said only "still pending".
        after = (
            UNSERVED_AFTER_S if args.timeout is None else min(UNSERVED_AFTER_S, 0.8 * args.timeout)
        )
        watch = asyncio.create_task(_warn_unserved(store, bus, submitted, settings.shards, after))
        try:
            if sys.stderr.isatty():  # live progress for a person; nothing extra for a script
                with LiveProgress(sys.stderr) as view:
                    wf = submitted.workflow_id
                    status = await router.wait(wf, args.timeout, progress=view.update)
            else:
                status = await router.wait(submitted.workflow_id, args.timeout)
        except TimeoutError as exc:
            raise CliError(str(exc), EXIT_TIMEOUT) from None
        finally:
            watch.cancel()
    if status["status"] == "completed":
        _print(json.dumps(status["result"]))
        return 0
    # A handler's own words, for the operator's terminal: escaped, as `explain` shows them.
    error = clean(status["error"], 2000)
    saga = status.get("compensations") or {}
    if saga.get("error"):  # a compensation failed too (or was stopped)
        error = f"{error}; {clean(saga['error'], 2000)}"
    raise CliError(f"program {status['status']}: {error}", EXIT_FAILED)


def _no_program(settings: Settings, wf: str) -> CliError:
    """No such program, and where it was looked for: a prefix or a Redis database left unset
    (another cluster's) is the likeliest cause. Host, port and database only: never the URL,
    which may hold a password."""
    return CliError(f"no program {wf!r} ({_looked_in(settings)})", EXIT_FAILED)


def _looked_in(settings: Settings) -> str:
    return f"prefix {settings.prefix!r}, Redis {redis_place(settings)}"


def _say_not_created(submitted: Submitted) -> None:
    """A script without --wait sees only the id: that nothing ran goes to stderr."""
    if submitted.created:
        return
    wf, status = clean(submitted.workflow_id, 200), submitted.status
    if status in TERMINAL:
        said = (
            f"{wf} exists already and ended {status}: not started again "
            "(`shardflow redrive` runs a failed or cancelled one again)"
        )
    else:
        said = f"{wf} exists already ({status}): not submitted again"
    print(f"shardflow: note: {said}", file=sys.stderr)


# A program still pending this long after `submit --wait` sent it, on a shard no orchestrator
# consumes, is said to wait for one (longer than an orchestrator takes to start beside it).
UNSERVED_AFTER_S = 3.0


async def _warn_unserved(
    store: Store, bus: Bus, submitted: Submitted, shards: int, after: float
) -> None:
    """Say so on stderr, once, when the program still waits for an orchestrator `after`
    seconds on: `--wait` said nothing while it hung (a `dev --shards 2` beside a client's
    default 4)."""
    await asyncio.sleep(after)
    try:
        state = await store.state(submitted.workflow_id)
        queue = await bus.queue_state(bus.names.shard_queue(submitted.shard))
    except Exception:  # only a hint: the wait goes on and says what it finds
        return
    if state.get("status") == "pending" and queue is not None and queue[1] == 0:
        print(
            f"shardflow: warning: no orchestrator consumes shard {submitted.shard} (of "
            f"SHARDFLOW_SHARDS={shards}): the program waits until one does. `shardflow shards` "
            "shows each shard's consumers: do the orchestrators run with this SHARDFLOW_SHARDS?",
            file=sys.stderr,
        )


# How long a command waits for RabbitMQ to take the message it publishes (its confirm). A
# memory or disk alarm blocks every publishing connection until it clears: submit, cancel,
# signal and redrive hung for its whole length, and a submit interrupted meanwhile had
# printed no id, though its program was recorded (a retry submitted it twice).
BROKER_WAIT_S = 15.0
BROKER_SLOW = (
    f"RabbitMQ took no message of this command in {BROKER_WAIT_S:g}s (a memory or disk alarm "
    "blocks publishing, or the broker is slow)"
)


class _BrokerSlow(Exception):
    pass


async def _broker_bound(call: Awaitable[T]) -> T:
    """`call`'s result, or _BrokerSlow after BROKER_WAIT_S (what it wrote to Redis stands)."""
    try:
        return await within(call, BROKER_WAIT_S)
    except TimeoutError:
        raise _BrokerSlow from None


def _read_program(path: Path, max_bytes: int) -> str:
    """The file's text, reading no more than one byte past the limit (`/dev/zero` ends)."""
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(max_bytes + 1)
        else:
            with path.open("rb") as file:
                data = file.read(max_bytes + 1)
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise CliError(f"{path}: over {max_bytes} bytes (SHARDFLOW_MAX_PROGRAM_BYTES)")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text") from None


async def _status(settings: Settings, args: argparse.Namespace) -> int:
    _check_id(args.id)
    store = RedisStore.connect(settings)
    try:
        router = Router(settings, store=store)
        status = await router.status(args.id)
    finally:
        await store.close()
    if status is None:
        raise _no_program(settings, args.id)
    _print(json.dumps(status, indent=2))
    return 0


async def _list(settings: Settings, args: argparse.Namespace) -> int:

    store = RedisStore.connect(settings)
    try:
        # On Redis's clock, which stamped created_ms: not this terminal's.
        since_ms = None if args.since is None else int((await store.now() - args.since) * 1000)
        page = await Router(settings, store=store).list_programs(
            statuses=args.status,
            name=args.name,
            since_ms=since_ms,
            before=_before(args.before),
            limit=args.limit,
        )
    except ListError as exc:
        raise CliError(str(exc)) from None
    finally:
        await store.close()
    if args.json:
        for program in page.programs:
            _print(json.dumps(program))
    else:
        _print(list_table(page.programs))
    if page.more:
        print(f"shardflow: more may match: --before {page.more}", file=sys.stderr)
    unfiltered = not (args.status or args.name or args.since is not None or args.before)
    if not page.programs and unfiltered:  # a prefix or database left unset, most likely
        print(f"shardflow: note: no programs ({_looked_in(settings)})", file=sys.stderr)
    return 0


def _check_id(workflow_id: str) -> None:
    try:
        check_workflow_id(workflow_id)
    except ValueError as exc:
        raise CliError(f"id: {exc}") from None


async def _explain(settings: Settings, args: argparse.Namespace) -> int:
    _check_id(args.id)
    store = RedisStore.connect(settings)
    try:
        async with contextlib.AsyncExitStack() as stack:
            bus: Bus | None = None
            try:
                bus = await stack.enter_async_context(connected_bus(settings, "shardflow-explain"))
            except UNREACHABLE as exc:  # only the queues' depths and consumers are RabbitMQ's
                print(
                    f"shardflow: note: cannot connect to RabbitMQ (SHARDFLOW_AMQP_URL): {exc}; "
                    "the queues' depths and consumers are not shown",
                    file=sys.stderr,
                )
            report = await Router(settings, store=store, bus=bus).explain(args.id)
    finally:
        await store.close()
    if report is None:
        raise _no_program(settings, args.id)
    _print(json.dumps(report, indent=2) if args.json else explain_text(report))
    return 0


async def _signal(settings: Settings, args: argparse.Namespace) -> int:
    _check_id(args.id)
    data = parse_document(args.data, what="--data", max_bytes=MAX_SIGNAL_BYTES)
    async with connected(settings, "shardflow-signal") as (store, bus):
        router = Router(settings, store=store, bus=bus)
        try:
            sent = await _broker_bound(router.signal(args.id, args.name, data, args.signal_id))
        except _BrokerSlow:
            again = (
                "send it again with the same --signal-id: it is taken once"
                if args.signal_id
                else "without --signal-id, sending it again keeps a second one: see `explain`"
            )
            raise CliError(
                f"{BROKER_SLOW}; the signal is kept if the program waits for it ({again})",
                EXIT_UNAVAILABLE,
            ) from None
        except NoProgram:
            raise _no_program(settings, args.id) from None
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    _print(json.dumps(sent))
    return 0


async def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    _check_id(args.id)
    if not args.reason.strip():  # recorded as the error: an empty one shows as none at all
        raise CliError("--reason: empty; say why, or leave it out (it is then 'cancelled')")
    async with connected(settings, "shardflow-cancel") as (store, bus):
        try:
            router = Router(settings, store=store, bus=bus)
            status = await _broker_bound(
                router.cancel(args.id, args.reason, stop_compensations=args.stop_compensations)
            )
        except _BrokerSlow:
            raise CliError(
                f"{BROKER_SLOW}; the program is cancelled in Redis (`status` says so), and the "
                "notice that stops its running tasks goes once RabbitMQ takes it",
                EXIT_UNAVAILABLE,
            ) from None
        except NoProgram:
            raise _no_program(settings, args.id) from None
    if "note" in status:  # a person may miss it in the JSON
        print(f"shardflow: {status['note']}", file=sys.stderr)
    _print(json.dumps(status, indent=2))
    return 0


async def _redrive(settings: Settings, args: argparse.Namespace) -> int:
    _check_id(args.id)
    async with connected(settings, "shardflow-redrive") as (store, bus):
        try:
            router = Router(settings, store=store, bus=bus)
            status = await _broker_bound(router.redrive(args.id, args.from_step))
        except _BrokerSlow:
            raise CliError(
                f"{BROKER_SLOW}; if `status` says pending, the redrive is recorded and its "
                "owner's sweep starts it",
                EXIT_UNAVAILABLE,
            ) from None
        except NoProgram:
            raise _no_program(settings, args.id) from None
        except RedriveError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    _print(json.dumps(status, indent=2))
    return 0


async def _purge(settings: Settings, args: argparse.Namespace) -> int:
    store = RedisStore.connect(settings)
    try:
        counts = await purge(store, statuses=args.status or TERMINAL, older_than_s=args.older_than)
    finally:
        await store.close()
    _print(json.dumps({name: counts[name] for name in ("purged", "live", "kept", "missing")}))
    return 0


async def _dead(settings: Settings, args: argparse.Namespace) -> int:

    if args.older_than is not None and not args.purge:
        raise CliError("--older-than goes with --purge")
    if args.purge and args.requeue:
        raise CliError("--purge or --requeue, not both")
    if not (args.purge or args.requeue) and (args.limit or 0) > MAX_DEAD:
        raise CliError(f"--limit: at most {MAX_DEAD} when listing (they are held in memory)")
    # RabbitMQ alone: the letters pile up while Redis is away, and must be seen then too.
    async with connected_bus(settings, "shardflow-dead") as bus:
        if args.requeue:
            most = args.limit or MAX_DEAD_PURGE
            sent, kept, left = await bus.resend_dead(functools.partial(sent_back, bus.names), most)
            _print(json.dumps({"requeued": sent, "kept": kept, "left": left}))
            return 0
        if args.purge:
            old = None if args.older_than is None else parked_before(args.older_than)
            # Neither --limit nor --older-than: the whole queue at once.
            most = args.limit or (None if old is None else MAX_DEAD_PURGE)
            deleted, left = await bus.purge_dead(old, most)
            _print(json.dumps({"purged": deleted, "left": left}))
            return 0
        messages = await bus.peek_dead(args.limit or DEAD_LISTED)
    for headers, body in messages:
        line = {
            "reason": headers.get("x-shardflow-reason") or death_reason(headers),
            "from": headers.get("x-shardflow-from"),
            "at": parked_at(headers),
            "body": body.decode(errors="replace")[:500],
        }
        if not _utf8(body):  # shown lossily above: its bytes as they are (sent back intact)
            line["body_base64"] = base64.b64encode(body[:500]).decode()
        # Parked by the broker, a message has its sender's headers: any AMQP value.
        _print(json.dumps(line, default=str))
    return 0


async def _shards(settings: Settings, args: argparse.Namespace) -> int:

    async with connected(settings, "shardflow-shards", declare=False) as (store, bus):
        for shard in sorted(set(range(settings.shards)) | await store.shards_used()):
            queue = await bus.shard_queue_state(shard)
            depth, consumers = queue if queue is not None else (0, 0)
            in_flight = await store.in_flight(shard)
            if shard < settings.shards:
                state = "ring"
            else:
                state = "draining" if depth or in_flight else "removable"
            line = {
                "shard": shard,
                "queue": bus.names.shard_queue(shard),
                "depth": depth,
                "consumers": consumers,
                "in_flight": in_flight,
                "state": state,
            }
            _print(json.dumps(line))
    return 0


async def _schema(settings: Settings, args: argparse.Namespace) -> int:
    _print(json.dumps(program_schema(), indent=2))
    return 0


_COMMANDS: dict[str, Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "dev": _dev,
    "orchestrator": _orchestrator,
    "worker": _worker,
    "router": _router,
    "submit": _submit,
    "status": _status,
    "list": _list,
    "explain": _explain,
    "signal": _signal,
    "cancel": _cancel,
    "redrive": _redrive,
    "purge": _purge,
    "dead": _dead,
    "shards": _shards,
    "schema": _schema,
}
