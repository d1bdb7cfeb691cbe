"""The `shardflow` command as a user runs it: real processes, one-line errors, exit codes."""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from orchestrator.settings import Settings, redis_place
from router.hashing import shard_for
from tests.brokers import free_port

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "thumbnails.json"


def shardflow(*args: str, env: dict[str, str] | None = None, timeout: float = 60, stdin: str = ""):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "shardflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        input=stdin,
    )


def _schema_to(stdout: int) -> subprocess.CompletedProcess[str]:
    """`shardflow schema` writing to a file descriptor of the test's choosing."""
    return subprocess.run(
        [sys.executable, "-m", "shardflow", "schema"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def environment(settings: Settings) -> dict[str, str]:
    return {
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_SHARDS": "3",
    }


def no_program(wf: str, env: dict[str, str]) -> str:
    """What a command says of a program it cannot find, and where it looked (redis_place:
    tested on its own below)."""
    where = redis_place(Settings(redis_url=env["SHARDFLOW_REDIS_URL"]))
    return f"no program {wf!r} (prefix {env['SHARDFLOW_PREFIX']!r}, Redis {where})"


@pytest.mark.parametrize(
    ("url", "cluster", "said"),
    [
        ("redis://127.0.0.1:6379/0", False, "127.0.0.1:6379/0"),
        ("redis://:secret@h:6380?db=4", False, "h:6380/4"),  # the client's db: the query's
        ("redis://user:pw@host/5?db=7", False, "host:6379/7"),
        ("redis://[::1]:6379/2", False, "[::1]:6379/2"),
        ("unix:///tmp/r.sock?db=2", False, "/tmp/r.sock/2"),
        ("rediss://h", False, "h:6379/0"),
        ("redis:///0", False, "localhost:6379/0"),
        ("redis://:secret@node-1:7000", True, "Cluster node-1:7000"),
    ],
)
def test_where_no_program_was_found_is_said_without_the_password(
    url: str, cluster: bool, said: str
) -> None:
    place = redis_place(Settings(redis_url=url, redis_cluster=cluster))
    assert place == said and "secret" not in place and "pw" not in place


@pytest.fixture
def dev(settings: Settings) -> Iterator[dict[str, str]]:
    """`shardflow dev --app examples.tasks` running in its own process; stopped with SIGTERM."""
    env = environment(settings)
    process = subprocess.Popen(
        [sys.executable, "-m", "shardflow", "dev", "--app", "examples.tasks"],
        cwd=ROOT,
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    yield env
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert "orchestrator: stopped" in stderr


def test_the_demo_program_runs_end_to_end(dev: dict[str, str]) -> None:
    done = shardflow(
        "submit",
        str(EXAMPLE),
        "--input",
        '{"album": "holiday"}',
        "--wait",
        "--timeout",
        "60",
        env=dev,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"published": "holiday", "after_polls": 3}
    workflow_id = done.stderr.strip().splitlines()[-1]
    status = shardflow("status", workflow_id, env=dev)
    assert status.returncode == 0
    assert json.loads(status.stdout)["status"] == "completed"


def test_the_readmes_demo_command_runs_and_prints_the_result(settings: Settings) -> None:
    # `bash scripts/demo.sh` exactly as the README gives it (on this run's vhost and prefix):
    # it once re-submitted its id without the input, which the router rightly refuses.
    env = {**os.environ, **environment(settings), "SHARDFLOW_SHARDS": "4"}
    demo = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    last = demo.stdout.strip().splitlines()[-1]
    assert last == 'demo: result: {"published": "holiday", "after_polls": 3}', demo.stdout
    readme = (ROOT / "README.md").read_text()
    assert last in readme  # the README shows what the demo prints


def test_submit_without_wait_prints_the_id_and_a_failed_program_exits_1(
    dev: dict[str, str], tmp_path: Path
) -> None:
    program = tmp_path / "p.json"
    program.write_text(json.dumps({"steps": [{"task": "resize"}]}))  # no args: KeyError
    started = shardflow("submit", str(program), "--id", "cli-fail", env=dev)
    assert (started.returncode, started.stdout) == (0, "cli-fail\n")
    waited = shardflow("submit", str(program), "--id", "cli-fail", "--wait", env=dev)
    assert waited.returncode == 1
    assert waited.stderr.strip().splitlines()[-1] == (
        "shardflow: program failed: step 0: task 'resize': KeyError: 'width'"
    )
    # Submitted again without --wait: the id, and on stderr that nothing ran.
    again = shardflow("submit", str(program), "--id", "cli-fail", env=dev)
    assert (again.returncode, again.stdout) == (0, "cli-fail\n")
    assert again.stderr == (
        "shardflow: note: cli-fail exists already and ended failed: not started again "
        "(`shardflow redrive` runs a failed or cancelled one again)\n"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["submit", "missing.json"], "shardflow: missing.json: No such file or directory"),
        (["submit", "-", "--input", "{nope"], "shardflow: input: not JSON: Expecting property"),
        (["submit", "-", "--id", "bad id!"], "shardflow: id: workflow id 'bad id!': use 1-128"),
        (
            ["submit", "-", "--app", "examples.tasks"],
            "shardflow: steps[0].task: unknown task 'nope'",
        ),
        # `$` matched before a trailing newline: the id was recorded, then refused.
        (["submit", "-", "--id", "abc\n"], "shardflow: id: workflow id 'abc\\n': use 1-128"),
        (["status", "abc\n"], "shardflow: id: workflow id 'abc\\n': use 1-128"),
        (["cancel", "abc\n"], "shardflow: id: workflow id 'abc\\n': use 1-128"),
        # Each of these was a traceback (RecursionError, UnicodeEncodeError), exit 1.
        (
            ["submit", "-", "--input", "[" * 60_000 + "]" * 60_000],
            "shardflow: input: nested deeper than 64 levels",
        ),
        (
            ["submit", "-", "--input", '"\udcff"'],  # the byte 0xff, as the shell passes it
            "shardflow: input: not UTF-8 text (a lone surrogate '\\udcff')",
        ),
        (["status", "\udcff"], "shardflow: id: not UTF-8 text"),
        (["cancel", "x", "--reason", "\udcff"], "shardflow: reason: not UTF-8 text"),
        # Each of these was accepted.
        (["submit", "-", "--input", '{"a": 1, "a": 2}'], "shardflow: input: duplicate key 'a'"),
        (["submit", "-", "--input", "[NaN]"], "shardflow: input: NaN is not JSON"),
        (["submit", "-", "--input", "1e999"], "shardflow: input: number '1e999' is out of range"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(
    settings: Settings, args: list[str], error: str
) -> None:
    stdin = (
        json.dumps({"steps": [{"task": "nope"}]})
        if "--app" in args
        else '{"steps": [{"task": "a"}]}'
    )
    result = shardflow(*args, env=environment(settings), stdin=stdin)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(error), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_pool_outside_shardflow_pools_is_refused_at_submit(settings: Settings) -> None:
    env = {**environment(settings), "SHARDFLOW_POOLS": "billing"}
    program = json.dumps({"steps": [{"task": "a", "pool": "billng"}]})
    result = shardflow("submit", "-", env=env, stdin=program)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "shardflow: steps[0].pool: pool 'billng' is not one of SHARDFLOW_POOLS (billing; "
        "serial and parallel "
        "always are)\n"
    )
    bad = shardflow("submit", "-", env={**env, "SHARDFLOW_POOLS": "Billing"}, stdin=program)
    assert bad.returncode == 2
    assert bad.stderr.startswith("shardflow: settings: SHARDFLOW_POOLS: 'Billing' is not a pool")


def test_an_invalid_program_names_the_path_of_the_fault(settings: Settings) -> None:
    loop = {"until": "prev ==", "max_iterations": 2, "steps": [{"task": "a"}]}
    bad = json.dumps({"steps": [{"task": "a"}, loop]})
    result = shardflow("submit", "-", env=environment(settings), stdin=bad)
    assert result.returncode == 2
    assert result.stderr.startswith("shardflow: steps[1].until: invalid CEL: Failed to parse")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("program", "error"),
    [
        ("[" * 100_000 + "]" * 100_000, "shardflow: program: nested deeper than 64 levels\n"),
        (
            '{"steps": [{"task": "a"}], "steps": [{"task": "b"}]}',
            "shardflow: program: duplicate key 'steps'\n",
        ),
        (
            '{"steps": [{"task": "a", "timeout_s": Infinity}]}',
            "shardflow: program: Infinity is not JSON\n",
        ),
        (
            json.dumps(
                {
                    "steps": [
                        {
                            "until": "prev == " + "1 + " * 2500 + "1",
                            "max_iterations": 2,
                            "steps": [{"task": "a"}],
                        },
                    ]
                }
            ),  # 10 KB of CEL, which used to be echoed in the error
            "shardflow: steps[0].until: String should have at most 1000 characters\n",
        ),
    ],
)
def test_hostile_programs_get_one_short_line_and_exit_2(
    settings: Settings, program: str, error: str
) -> None:
    result = shardflow("submit", "-", env=environment(settings), stdin=program)
    assert (result.returncode, result.stderr) == (2, error)


def test_a_long_invalid_condition_is_quoted_short(settings: Settings) -> None:
    until = "prev.x == " + " + ".join(["1"] * 220) + " +"  # 889 characters, a syntax error
    loop = {"until": until, "max_iterations": 2, "steps": [{"task": "a"}]}
    result = shardflow(
        "submit", "-", env=environment(settings), stdin=json.dumps({"steps": [loop]})
    )
    assert result.returncode == 2
    assert result.stderr.startswith(
        "shardflow: steps[0].until: invalid CEL: Failed to parse expression 'prev.x == 1 + 1"
    )
    assert "… (889 characters)" in result.stderr
    assert len(result.stderr) < 400 and len(result.stderr.splitlines()) == 1


def test_a_closed_stdout_ends_quietly_like_a_command_killed_by_sigpipe() -> None:
    # `shardflow schema | head -1` used to say "cannot connect: [Errno 32] Broken pipe", exit 4.
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        result = _schema_to(write_end)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_status_of_an_unknown_program_exits_1(settings: Settings) -> None:
    env = environment(settings)
    result = shardflow("status", "never-submitted", env=env)
    said = no_program("never-submitted", env)
    assert (result.returncode, result.stderr) == (1, f"shardflow: {said}\n")


def test_a_misspelled_option_is_named_by_its_commands_parser_with_the_one_it_resembles() -> None:
    """argparse said it with the top-level usage, and no hint."""
    result = shardflow("submit", "p.json", "--wiat", "--timout", "5", "\x1b[31m")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: shardflow submit "), result.stderr
    assert result.stderr.splitlines()[-1] == (
        "shardflow submit: error: unrecognized arguments: --wiat --timout 5 \\x1b[31m "
        "(--wiat: did you mean --wait?; --timout: did you mean --timeout?)"
    )


def test_a_misspelled_setting_is_warned_of_with_the_name_it_resembles(settings: Settings) -> None:
    """A typo left its setting at the default without a word: `SHARDFLOW_PREFX` looked under
    prefix `sf`, which may be another cluster's."""
    env = {**environment(settings), "SHARDFLOW_PREFX": "mine", "SHARDFLOW_ZZZ": "1"}
    result = shardflow("status", "never-submitted", env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines()[:2] == [
        "shardflow: warning: SHARDFLOW_PREFX is no setting (did you mean SHARDFLOW_PREFIX?): "
        "ignored",
        "shardflow: warning: SHARDFLOW_ZZZ is no setting: ignored",
    ]


def test_unknown_variables_are_bounded_and_skip_names_read_elsewhere() -> None:
    from orchestrator.settings import MAX_UNKNOWN_SAID, unknown_variables

    read = {"SHARDFLOW_LOG_LEVEL": "x", "SHARDFLOW_TEST_DRAIN": "1", "shardflow_prefix": "p"}
    # Kubernetes's service links of a Service named shardflow-metrics: not ours to warn of.
    links = {
        "SHARDFLOW_METRICS_SERVICE_HOST": "10.0.0.7",
        "SHARDFLOW_METRICS_SERVICE_PORT_METRICS": "9464",
        "SHARDFLOW_METRICS_PORT_9464_TCP_ADDR": "10.0.0.7",
        "SHARDFLOW_REDIS_PORT": "tcp://10.0.0.8:6379",
    }
    assert unknown_variables({**read, **links, "PATH": "/bin"}) == []
    typo = unknown_variables({"SHARDFLOW_METRIC_PORT": "9000"})  # no link's value: a typo
    assert typo == [
        "SHARDFLOW_METRIC_PORT is no setting (did you mean SHARDFLOW_METRICS_PORT?): ignored"
    ]
    many = {f"SHARDFLOW_X{n}\n": "1" for n in range(20)}
    said = unknown_variables(many)
    assert len(said) == MAX_UNKNOWN_SAID + 1 and said[-1].startswith("and more")
    assert all("\n" not in line for line in said), said  # a name is shown escaped


def test_bad_settings_and_unreachable_services_are_one_line(settings: Settings) -> None:
    bad = shardflow("status", "x", env={"SHARDFLOW_SHARDS": "zero"})
    assert bad.returncode == 2
    assert bad.stderr.startswith("shardflow: settings: SHARDFLOW_SHARDS: Input should be a valid")
    down = shardflow("status", "x", env={"SHARDFLOW_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert down.returncode == 4
    assert down.stderr.startswith("shardflow: cannot connect to Redis (SHARDFLOW_REDIS_URL): ")
    assert len(down.stderr.strip().splitlines()) == 1
    amqp = {"SHARDFLOW_AMQP_URL": "amqp://guest:secret@127.0.0.1:1/"}
    away = shardflow("shards", env={**environment(settings), **amqp})
    assert away.returncode == 4 and "secret" not in away.stderr
    assert away.stderr.startswith("shardflow: cannot connect to RabbitMQ (SHARDFLOW_AMQP_URL): ")


def test_a_service_that_answers_wrongly_or_never_is_one_line_and_exit_4(
    settings: Settings,
) -> None:
    """Each was a traceback, or a command that waited for good: a Redis URL at RabbitMQ's port,
    and a RabbitMQ URL at a port that takes the connection and never answers."""
    amqp_port = urlsplit(settings.amqp_url).port or 5672
    not_redis = {"SHARDFLOW_REDIS_URL": f"redis://127.0.0.1:{amqp_port}/0"}
    wrong = shardflow("status", "x", env={**environment(settings), **not_redis})
    assert wrong.returncode == 4, wrong.stderr
    assert wrong.stderr.startswith("shardflow: cannot connect to Redis (SHARDFLOW_REDIS_URL)")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = {"SHARDFLOW_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{silent.getsockname()[1]}/"}
        never = shardflow("shards", env={**environment(settings), **mute})
    assert never.returncode == 4, never.stderr
    assert never.stderr.startswith("shardflow: cannot connect to RabbitMQ (SHARDFLOW_AMQP_URL)")
    cluster = {"SHARDFLOW_REDIS_CLUSTER": "true", "SHARDFLOW_REDIS_URL": "redis://127.0.0.1:1/0"}
    no_node = shardflow("status", "x", env={**environment(settings), **cluster})
    assert no_node.returncode == 4 and "Traceback" not in no_node.stderr, no_node.stderr
    assert no_node.stderr.startswith("shardflow: cannot connect to Redis (SHARDFLOW_REDIS_URL)")


async def test_commands_that_only_look_create_no_queue(settings: Settings) -> None:
    """A mistyped prefix or shard count in an operator's shell made `shards`, `explain` and
    `dead` declare a whole topology that nobody consumes."""
    import aio_pika

    from orchestrator.keys import Names

    env = {**environment(settings), "SHARDFLOW_PREFIX": settings.prefix + "-typo"}
    shards = shardflow("shards", env=env)
    assert shards.returncode == 0, shards.stderr
    assert [json.loads(line)["consumers"] for line in shards.stdout.splitlines()] == [0, 0, 0]
    # Where it looked, since a prefix or a database left unset is the likeliest cause.
    assert shardflow("explain", "x", env=env).stderr == f"shardflow: {no_program('x', env)}\n"
    dead = shardflow("dead", env=env)
    assert (dead.returncode, dead.stdout) == (0, "")
    purged = shardflow("dead", "--purge", env=env)
    assert json.loads(purged.stdout) == {"purged": 0, "left": 0}
    names = Names(settings.prefix + "-typo")
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        for queue in (names.shard_queue(0), names.dead_queue, names.task_queue("parallel")):
            channel = await connection.channel()
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_queue(queue, passive=True)
    finally:
        await connection.close()


def test_the_log_level_goes_before_or_after_the_command() -> None:
    from shardflow.cli import _parser

    parser = _parser()
    assert parser.parse_args(["status", "x", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "status", "x"]).log_level == "ERROR"
    unset = os.environ.get("SHARDFLOW_LOG_LEVEL")
    assert parser.parse_args(["status", "x"]).log_level == ((unset or None) and unset.upper())


def test_every_commands_help_says_what_it_does_and_its_exit_codes() -> None:
    """`status`, `list`, `explain` and `cancel` had a usage line and options alone, and no
    command's help gave the exit codes (they were in the README only)."""
    from shardflow.cli import EXIT_CODES, _parser

    parser = _parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert parser.epilog == EXIT_CODES
    for name, command in commands.choices.items():
        assert command.description and len(command.description) > 40, name
        assert command.epilog == EXIT_CODES, name
    assert "Exit codes: 0 done" in shardflow("cancel", "--help").stdout


def test_a_short_command_logs_warnings_only_unless_told(settings: Settings) -> None:
    """`cancel` printed `INFO orchestrator.ending: ... ended cancelled` before its JSON."""
    env = {**environment(settings), "SHARDFLOW_LOG_LEVEL": ""}  # unset, as a user's shell
    program = json.dumps({"steps": [{"sleep_s": 60}]})
    ids = [shardflow("submit", "-", env=env, stdin=program).stdout.strip() for _ in range(2)]
    quiet = shardflow("cancel", ids[0], env=env)
    assert (quiet.returncode, quiet.stderr) == (0, ""), quiet.stderr
    told = shardflow("cancel", ids[1], "--log-level", "info", env=env)
    assert told.returncode == 0 and f"{ids[1]}: ended cancelled" in told.stderr, told.stderr


def test_an_app_that_fails_at_import_and_a_full_stdout_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('no config')\n")
    app = {"PYTHONPATH": str(tmp_path)}
    broken = shardflow("worker", "--pool", "reports", "--app", "broken_app", env=app)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr, broken.stderr
    assert broken.stderr == (
        f"shardflow: --app broken_app: importing it raised RuntimeError at "
        f"{tmp_path / 'broken_app.py'}:1: no config\n"
    )
    (tmp_path / "bad_syntax.py").write_text("x = 1\ndef (:\n")
    apps = ("--app", "examples.tasks", "--app", "bad_syntax")
    syntax = shardflow("worker", "--pool", "reports", *apps, env=app)
    assert syntax.returncode == 2, syntax.stderr
    assert syntax.stderr.startswith(
        f"shardflow: --app bad_syntax: importing it raised SyntaxError at "
        f"{tmp_path / 'bad_syntax.py'}:2: "
    ), syntax.stderr
    (tmp_path / "needs_dep.py").write_text("import nosuchdep_xyz\n")
    dep = shardflow("worker", "--pool", "reports", "--app", "needs_dep", env=app)
    assert dep.stderr == (
        "shardflow: --app needs_dep: importing it raised ModuleNotFoundError at "
        f"{tmp_path / 'needs_dep.py'}:1: No module named 'nosuchdep_xyz'\n"
    )
    (tmp_path / "exits_app.py").write_text("import sys\nsys.exit('config missing')\n")
    exits = shardflow("worker", "--pool", "reports", "--app", "exits_app", env=app)
    assert exits.returncode == 2 and exits.stderr == (  # was `config missing` alone, exit 1
        f"shardflow: --app exits_app: importing it raised SystemExit at "
        f"{tmp_path / 'exits_app.py'}:2: config missing\n"
    ), exits.stderr
    colon = shardflow("worker", "--pool", "reports", "--app", "examples.tasks:app", env=app)
    assert colon.returncode == 2 and colon.stderr == (
        "shardflow: --app examples.tasks:app: a module's name, without ':' (its @task() "
        "functions are found in it): --app examples.tasks\n"
    ), colon.stderr
    bare = shardflow("worker", "--pool", "reports", "--app", "tasks.py", env=app)
    assert bare.stderr == "shardflow: --app tasks.py: a module's name, not a file's: --app tasks\n"
    path = shardflow("worker", "--pool", "reports", "--app", "examples/tasks.py", env=app)
    assert path.stderr == (
        "shardflow: --app examples/tasks.py: a module's name, not a file's: --app examples.tasks\n"
    )
    (tmp_path / "empty_app.py").write_text("def forgot_the_decorator(ctx): pass\n")
    empty = shardflow("worker", "--pool", "serial", "--app", "empty_app", env=app)
    assert empty.returncode == 2, empty.stderr
    assert empty.stderr.startswith("shardflow: --app empty_app: no @task() handler in it")
    with open("/dev/full", "w") as full:
        schema = _schema_to(full.fileno())
    assert (schema.returncode, schema.stderr) == (
        1,
        "shardflow: cannot write to stdout: No space left on device\n",
    )


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        # Each of these was a traceback (exit 1), or was taken and misbehaved.
        (["--log-level", "LOUD", "schema"], {}, "argument --log-level: 'LOUD' (or SHARDFLOW_LOG"),
        (["shards"], {"SHARDFLOW_LOG_LEVEL": "LOUD"}, "argument --log-level: 'LOUD'"),
        (["schema", "--log-level", "LOUD"], {}, "argument --log-level: 'LOUD' (or SHARDFLOW_LO"),
        (["dev", "--shards", "0"], {}, "argument --shards: '0': a number from 1 to 1024"),
        (["dev", "--shards", "1000000000"], {}, "argument --shards: '1000000000': a number"),
        (["orchestrator", "--shards", "-1"], {}, "argument --shards: '-1': shard numbers are"),
        (["dev", "--concurrency", "-3"], {}, "argument --concurrency: '-3': a number from 1"),
        (
            ["worker", "--pool", "parallel", "--app", "x", "--concurrency", "100000"],
            {},
            "argument --concurrency: '100000': a number from 1 to 1000",
        ),
        (["submit", "-", "--wait", "--timeout", "-1"], {}, "argument --timeout: '-1': seconds"),
        (["submit", "-", "--wait", "--timeout", "nan"], {}, "argument --timeout: 'nan': seconds"),
        (["dead", "--limit", "0"], {}, "argument --limit: '0': a number from 1 to 1000"),
        (["signal", "x", "go", "--data", "{bad"], {}, "shardflow: --data: not JSON"),
        (["submit", "/dev/zero"], {}, "shardflow: /dev/zero: over 262144 bytes"),
        (["list"], {"SHARDFLOW_REDIS_URL": "notaurl"}, "shardflow: settings: SHARDFLOW_REDIS_URL"),
        (
            ["list"],
            {"SHARDFLOW_REDIS_URL": "redis://127.0.0.1:6379/abc"},
            "shardflow: settings: SHARDFLOW_REDIS_URL: its path must be a database number",
        ),
        (["shards"], {"SHARDFLOW_AMQP_URL": "http://x/"}, "shardflow: settings: SHARDFLOW_AMQP"),
        (
            ["shards"],
            {"SHARDFLOW_AMQP_URL": "amqp://guest:guest@127.0.0.1:99999/"},
            "shardflow: settings: SHARDFLOW_AMQP_URL: its port must be a number from 0 to 65535",
        ),
        (
            ["list"],
            {"SHARDFLOW_REDIS_URL": "redis://127.0.0.1:6379/0?ssl_cert_reqs=none"},
            "SHARDFLOW_REDIS_URL: 'ssl_cert_reqs' is no option of Redis's (TLS ones need "
            "rediss://)",
        ),
        (["list"], {"SHARDFLOW_GRACE_S": "inf"}, "shardflow: settings: SHARDFLOW_GRACE_S: Input"),
        (["list"], {"SHARDFLOW_FAIR_SHARE": "nan"}, "shardflow: settings: SHARDFLOW_FAIR_SHARE"),
    ],
)
def test_bad_flags_and_settings_are_refused_in_one_line_with_exit_2(
    settings: Settings, args: list[str], env: dict[str, str], error: str
) -> None:
    result = shardflow(*args, env={**environment(settings), **env})
    assert result.returncode == 2, result.stderr
    assert error in result.stderr.splitlines()[-1], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("cut", ["/", "#", "?"])
@pytest.mark.parametrize("head", ["Xy9", "1234", "[Xy9]"])
def test_a_password_left_unencoded_is_refused_without_a_piece_of_it(
    settings: Settings, cut: str, head: str
) -> None:
    """A generated password with a '/', '#' or '?' splits its URL there: its pieces were
    quoted as the port or the database, or (digits first) read as a port, the user as the
    host, and the tail logged by aio-pika as the URL's query at every retry; one in '[...]'
    was quoted as no IPv6 address. An '@' in a vhost, after a whole netloc, is no such cut."""
    password = f"{head}{cut}Q+zS3cr="
    urls = {
        "SHARDFLOW_REDIS_URL": f"redis://:{password}@127.0.0.1:6379/0",
        "SHARDFLOW_AMQP_URL": f"amqp://guest:{password}@127.0.0.1:5672/",
    }
    for variable, url in urls.items():
        result = shardflow("shards", env={**environment(settings), variable: url}, timeout=20)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"shardflow: settings: {variable}: "), result.stderr
        assert "in its user or password must be percent-encoded" in result.stderr
        assert "Q+zS3cr" not in result.stderr and head.strip("[]") not in result.stderr, (
            result.stderr
        )
    vhost = settings.amqp_url.rsplit("/", 1)[0] + "/team@eu"  # refused by RabbitMQ, not here
    result = shardflow("shards", env={**environment(settings), "SHARDFLOW_AMQP_URL": vhost})
    assert "on vhost 'team@eu'" in result.stderr, result.stderr


def test_a_vhost_or_database_that_cannot_be_used_is_one_line(settings: Settings) -> None:
    vhost = settings.amqp_url.rsplit("/", 1)[0] + "/no-such-vhost-here"
    amqp = shardflow("shards", env={**environment(settings), "SHARDFLOW_AMQP_URL": vhost})
    user = urlsplit(settings.amqp_url).username
    assert (amqp.returncode, amqp.stderr) == (
        4,  # RabbitMQ says so of a connection limit or a vhost restarting too: waited for
        "shardflow: cannot connect to RabbitMQ (SHARDFLOW_AMQP_URL): it closed the connection "
        f"as it opened the vhost for user {user!r} on vhost 'no-such-vhost-here': does the "
        "vhost exist, and may this user use it? (or a connection limit is reached, or the "
        "vhost restarts: the broker's log says which)\n",
    )
    redis = settings.redis_url.rsplit("/", 1)[0] + "/99999"
    db = shardflow("status", "x", env={**environment(settings), "SHARDFLOW_REDIS_URL": redis})
    assert (db.returncode, db.stderr) == (
        4,
        "shardflow: cannot connect to Redis (SHARDFLOW_REDIS_URL): DB index is out of range\n",
    )


def test_orchestrator_refuses_shards_outside_the_ring(settings: Settings) -> None:
    result = shardflow("orchestrator", "--shards", "0,5", env=environment(settings))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "shardflow: --shards: shards [5] are outside the ring 0..2 (SHARDFLOW_SHARDS=3) "
        "and never owned a program"
    )


def test_schema_prints_the_program_json_schema() -> None:
    result = shardflow("schema")
    assert result.returncode == 0
    assert set(json.loads(result.stdout)["$defs"]) >= {"Task", "Bag", "Untiloop"}


async def test_poison_messages_are_parked_with_their_reason_and_listed(
    dev: dict[str, str], settings: Settings
) -> None:
    import aio_pika

    from orchestrator.connections import connected
    from orchestrator.keys import Names

    names = Names(settings.prefix)
    async with connected(settings):  # the queues exist before anything is published to them
        pass
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        for queue, body in [
            (names.shard_queue(1), b"{not json"),
            (names.task_queue("parallel"), b'{"wf": "w", "path": "0", "task": "t"}'),
        ]:
            await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue)
    listed: list[dict] = []
    for _ in range(50):
        listed = [json.loads(line) for line in shardflow("dead", env=dev).stdout.splitlines()]
        if len(listed) == 2:
            break
        await asyncio.sleep(0.1)
    by_queue = {entry["from"]: entry for entry in listed}
    shard = by_queue[names.shard_queue(1)]
    assert shard["reason"].startswith("message: Invalid JSON") and shard["body"] == "{not json"
    assert abs(shard["at"] - time.time() * 1000) < 60_000  # parked just now
    assert by_queue[names.task_queue("parallel")]["reason"] == "owner: Field required"
    # Listing leaves them where they are, and the cluster goes on working.
    assert len(shardflow("dead", env=dev).stdout.splitlines()) == 2
    done = shardflow("submit", str(EXAMPLE), "--input", '{"album": "a"}', "--wait", env=dev)
    assert done.returncode == 0, done.stderr


async def test_dead_lists_a_message_parked_with_any_sender_headers(
    dev: dict[str, str], settings: Settings
) -> None:
    """The broker parks a message (a quorum queue's delivery limit) with its sender's headers,
    any AMQP value: a timestamp or an `x-death` that is no list crashed the listing."""
    import datetime

    import aio_pika

    from orchestrator.connections import connected
    from orchestrator.keys import Names

    async with connected(settings):  # the dead-letter queue exists
        pass
    headers = {
        "x-shardflow-from": datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC),
        "x-death": "not a list",
    }
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        for body in (b"{}", b"\xff\xfe garbage"):
            message = aio_pika.Message(body, headers=headers)
            await channel.default_exchange.publish(
                message, routing_key=Names(settings.prefix).dead_queue
            )
    listed = shardflow("dead", env=dev)
    assert listed.returncode == 0, listed.stderr
    parked = {"reason": "unknown", "from": "2026-12-05 00:00:00+00:00", "at": None}
    # A body that is no UTF-8 is shown lossily, and as its bytes too.
    assert [json.loads(line) for line in listed.stdout.splitlines()] == [
        {**parked, "body": "{}"},
        {**parked, "body": "\ufffd\ufffd garbage", "body_base64": "//4gZ2FyYmFnZQ=="},
    ]


async def test_dead_purge_deletes_all_or_those_parked_before_a_time_in_order(
    dev: dict[str, str], settings: Settings
) -> None:
    """`dead --purge --older-than`: from the oldest on, up to the first parked since (what
    follows it is younger), which stays where it was; one with no time counts as old (it was
    parked before the rest: by a version that wrote none), and so does one stamped a day ahead
    (its parker's clock was: taken as young, it stopped the purge). `dead --purge`: all."""
    import aio_pika

    from orchestrator.connections import connected
    from orchestrator.keys import Names

    async with connected(settings):  # the dead-letter queue exists
        pass
    now = int(time.time() * 1000)
    parked = [None, now + 86400_000, now - 2 * 3600_000, now, now - 3 * 3600_000]
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        for k, at in enumerate(parked):
            headers = {"x-shardflow-reason": f"r{k}"}
            if at is not None:
                headers["x-shardflow-at"] = at
            message = aio_pika.Message(f"{k}".encode(), headers=headers)  # type: ignore[arg-type]
            await channel.default_exchange.publish(
                message, routing_key=Names(settings.prefix).dead_queue
            )
    alone = shardflow("dead", "--older-than", "1h", env=dev)
    assert alone.returncode == 2 and "--older-than goes with --purge" in alone.stderr
    purged = shardflow("dead", "--purge", "--older-than", "1h", env=dev)
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout) == {"purged": 3, "left": 2}
    # Listed while Redis is away: `dead` needs RabbitMQ alone.
    no_redis = {**dev, "SHARDFLOW_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    listing = shardflow("dead", env=no_redis)
    assert listing.returncode == 0, listing.stderr
    listed = [json.loads(line) for line in listing.stdout.splitlines()]
    assert [(entry["body"], entry["at"]) for entry in listed] == [("3", now), ("4", parked[4])]
    # --limit: at most that many, the oldest (it was ignored: every letter went).
    one = shardflow("dead", "--purge", "--limit", "1", env=no_redis)
    assert json.loads(one.stdout) == {"purged": 1, "left": 1}, one.stderr
    assert [
        json.loads(line)["body"] for line in shardflow("dead", env=dev).stdout.splitlines()
    ] == ["4"]
    assert json.loads(shardflow("dead", "--purge", env=dev).stdout) == {"purged": 1, "left": 0}
    assert shardflow("dead", env=dev).stdout == ""
    many = shardflow("dead", "--limit", "1001", env=dev)
    assert many.returncode == 2 and "--limit: at most 1000 when listing" in many.stderr


def test_dead_requeue_sends_each_back_to_its_own_queue_and_keeps_the_rest(
    settings: Settings,
) -> None:
    """What a fault since mended parked (a full Redis, before it was waited for) had no way
    back: `dead` could list and delete, never send again. A header naming a queue that is not
    this cluster's is not trusted: that letter stays."""
    import aio_pika

    from orchestrator.connections import connected
    from orchestrator.delivery import FAILURES, SENT_ID
    from orchestrator.keys import Names

    names = Names(settings.prefix)
    env = environment(settings)
    elsewhere = f"another-app-{settings.prefix}"  # a queue that exists, not shardflow's

    async def park() -> None:
        async with connected(settings) as (_, bus):  # declares the queues
            await bus._ensure_pool("parallel.3")  # a worker's, which this test has none of
            await bus._channel.declare_queue(elsewhere, arguments={"x-expires": 60_000})
            for body, source in ((b"a", names.task_queue("parallel.3")), (b"b", elsewhere),
                                 (b"c", None), (b"e", names.task_queue("gone")),
                                 (b"d", names.shard_queue(2))):  # fmt: skip
                headers: dict[str, Any] = {"x-shardflow-reason": "Redis full", FAILURES: 20}
                if source is not None:
                    headers["x-shardflow-from"] = source
                await bus._send(
                    "", names.dead_queue, body, aio_pika.Message(body, headers=headers).properties
                )  # type: ignore[arg-type]
            # An ingress request without a workflow id takes its id from its message id: sent
            # back without it, a request already recorded was submitted a second time.
            ingress = names.ingress_queue
            await bus.dead_letter(b"f", reason="Redis full", source=ingress, message_id="m-1")
            await bus._send("", names.dead_queue, b"g", aio_pika.Message(b"g", headers={
                "x-shardflow-from": ingress}).properties)  # fmt: skip  # parked by an older one
            death = [{"queue": ingress, "reason": "delivery_limit", "count": 1}]  # the broker's
            parked = aio_pika.Message(b"h", headers={"x-death": death}, message_id="m-2")
            await bus._send("", names.dead_queue, b"h", parked.properties)  # type: ignore[arg-type]

    asyncio.run(park())
    first = shardflow("dead", "--requeue", "--limit", "1", env=env)  # the oldest alone
    assert json.loads(first.stdout) == {"requeued": 1, "kept": 0, "left": 7}, first.stderr
    requeued = shardflow("dead", "--requeue", env=env)
    assert requeued.returncode == 0, requeued.stderr
    assert json.loads(requeued.stdout) == {"requeued": 3, "kept": 4, "left": 4}
    listed = [json.loads(line) for line in shardflow("dead", env=env).stdout.splitlines()]
    assert [entry["body"] for entry in listed] == ["b", "c", "e", "g"]  # in their order

    async def take(queue: str) -> tuple[bytes, dict[str, Any]]:
        async with await aio_pika.connect(settings.amqp_url) as connection:
            channel = await connection.channel()
            found = await (await channel.get_queue(queue)).get(no_ack=True)
            return found.body, dict(found.headers or {})

    body, headers = asyncio.run(take(names.task_queue("parallel.3")))
    assert body == b"a" and headers == {FAILURES: 0}  # counted as redelivered, reasons gone
    assert asyncio.run(take(names.shard_queue(2)))[0] == b"d"
    body, headers = asyncio.run(take(names.ingress_queue))
    assert body == b"f" and headers == {FAILURES: 0, SENT_ID: "m-1"}
    body, headers = asyncio.run(take(names.ingress_queue))  # the broker parked it: its own id
    assert body == b"h" and headers == {FAILURES: 0, SENT_ID: "m-2"}
    both = shardflow("dead", "--purge", "--requeue", env=env)
    assert both.returncode == 2 and "--purge or --requeue, not both" in both.stderr


def test_cancel_of_an_unknown_program_exits_1(settings: Settings) -> None:
    env = environment(settings)
    result = shardflow("cancel", "nothing-here", env=env)
    said = no_program("nothing-here", env)
    assert (result.returncode, result.stderr) == (1, f"shardflow: {said}\n")


def test_an_empty_cancel_reason_or_list_cursor_is_refused(settings: Settings) -> None:
    """An empty reason was recorded as the error, and `explain` showed none; an empty
    --before was taken as no cursor: a script's unset variable listed the first page again."""
    env = environment(settings)
    empty = shardflow("cancel", "nothing-here", "--reason", " ", env=env)
    assert (empty.returncode, empty.stderr) == (
        2,
        "shardflow: --reason: empty; say why, or leave it out (it is then 'cancelled')\n",
    )
    listed = shardflow("list", "--before", "", env=env)
    assert listed.returncode == 2 and "--before: empty" in listed.stderr, listed.stderr


def test_the_approval_example_waits_for_its_signal(dev: dict[str, str]) -> None:
    # As the README shows it: submit, then a person's decision arrives as a signal.
    example = str(EXAMPLE.parent / "approval.json")
    started = shardflow("submit", example, "--id", "refund-7", "--input",
                        '{"order": 7, "amount": 25.0}', env=dev)  # fmt: skip
    assert started.returncode == 0, started.stderr
    waiting = shardflow("explain", "refund-7", env=dev)
    deadline = time.monotonic() + 30
    while "Waiting for: a signal 'approval'" not in waiting.stdout:
        assert time.monotonic() < deadline, waiting.stdout
        time.sleep(0.2)
        waiting = shardflow("explain", "refund-7", env=dev)
    sent = shardflow("signal", "refund-7", "approval", "--data",
                     '{"approved": true, "by": "ann"}', env=dev)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout) == {
        "workflow_id": "refund-7", "signal": "approval", "duplicate": False, "waiting": 1
    }  # fmt: skip
    order = '{"order": 7, "amount": 25.0}'
    done = shardflow(
        "submit", example, "--id", "refund-7", "--input", order, "--wait", "--timeout", "30",
        env=dev,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"paid": 25.0, "order": 7, "by": "ann"}
    refused = shardflow("signal", "refund-7", "approval", env=dev)
    assert refused.returncode == 2
    assert "has ended (completed): not signalled" in refused.stderr
    unknown = shardflow("signal", "nobody", "approval", env=dev)
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1, f"shardflow: {no_program('nobody', dev)}"
    )  # fmt: skip


async def test_cancel_of_a_compensating_program_changes_nothing_unless_told_to_stop(
    settings: Settings,
) -> None:
    from orchestrator.redis_store import RedisStore

    env = environment(settings)
    store = RedisStore.connect(settings)
    undo = {"task": "t", "compensate": {"task": "u"}}
    plan = json.dumps({"program": {"steps": [undo, {"task": "t"}]}, "input": None, "owner": 0})
    await store.submit("cli-saga", plan, 0, "n", "d")
    await store.advance("cli-saga", "", "0", "running", leaf="task")
    await store.cancel("cli-saga", "cancelled", "first", compensates=True)
    await store.close()

    again = shardflow("cancel", "cli-saga", "--reason", "again", env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "compensating"
    assert "compensating: this cancel changed nothing" in again.stderr
    refused = shardflow("redrive", "cli-saga", env=env)
    assert refused.returncode == 2 and "cancel it first" not in refused.stderr
    stop = shardflow("cancel", "cli-saga", "--stop-compensations", "--reason", "x", env=env)
    assert stop.returncode == 0, stop.stderr
    status = json.loads(stop.stdout)
    assert status["status"] == "compensation_failed" and "note" not in status
    assert status["compensations"]["error"] == "compensations stopped by a cancel: x"
    ended = shardflow("cancel", "cli-saga", "--reason", "late", env=env)
    assert ended.returncode == 0, ended.stderr
    assert json.loads(ended.stdout)["note"] == (
        "the program had already ended compensation_failed: this cancel changed nothing"
    )
    assert "already ended compensation_failed" in ended.stderr


async def test_redrive_runs_an_ended_program_again_and_refuses_what_it_cannot(
    settings: Settings,
) -> None:
    from orchestrator.redis_store import RedisStore

    env = environment(settings)
    store = RedisStore.connect(settings)
    plan = json.dumps({"program": {"steps": [{"task": "t"}]}, "input": None, "owner": 0})
    for wf in ("cli-cancelled", "cli-other", "cli-done"):
        await store.submit(wf, plan, 0, "n", "d")
    await store.cancel("cli-cancelled", "cancelled", "by hand")
    await store.cancel("cli-other", "cancelled", "by hand")
    await store.advance("cli-done", "", "0", "running", leaf="task")
    await store.advance("cli-done", "0", "", "completed", "result", "1")
    await store.close()

    ok = shardflow("redrive", "cli-cancelled", env=env)
    assert ok.returncode == 0, ok.stderr
    status = json.loads(ok.stdout)
    assert (status["status"], status["run"]) == ("pending", 1)
    assert [(run["run"], run["status"], run["error"]) for run in status["runs"]] == [
        (0, "cancelled", "by hand")
    ]
    shown = json.loads(shardflow("status", "cli-cancelled", env=env).stdout)
    assert shown["runs"] == status["runs"]
    for args, code, error in [
        (
            ["cli-done"],
            2,
            "program 'cli-done' completed: only a failed or cancelled program can be "
            "redriven (submit it again under a new id)",
        ),
        (
            ["cli-cancelled"],
            2,
            "program 'cli-cancelled' is pending: only a failed or cancelled program can be "
            "redriven (cancel it first to run it again)",
        ),
        (["nothing-here"], 1, no_program("nothing-here", env)),
        (
            ["cli-other", "--from", "x"],
            2,
            "--from 'x': give a top-level step number (0..0); a step inside a loop or a "
            "choice runs again only as the failed one (none)",
        ),
        (
            ["bad\nid"],
            2,
            "id: workflow id 'bad\\nid': use 1-128 of A-Z a-z 0-9 . _ : @ -, "
            "starting with a letter or digit",
        ),
    ]:
        refused = shardflow("redrive", *args, env=env)
        assert (refused.returncode, refused.stderr) == (code, f"shardflow: {error}\n"), args
    helped = shardflow("redrive", "--help")
    assert helped.returncode == 0 and "--from STEP" in helped.stdout


def test_a_dead_letter_was_parked_when_the_broker_says_before_what_its_headers_say() -> None:
    """The broker parks a message with its sender's headers, ours too (a copy sent again keeps
    `x-shardflow-*`): its `x-death` time is when it was parked. Ours: `x-shardflow-at`."""
    import datetime

    from router.dead_letters import parked_at as _parked_at

    when = datetime.datetime(2026, 12, 5, 4, 0, tzinfo=datetime.UTC)
    death = {"reason": "delivery_limit", "queue": "q", "time": when}
    later = int(when.timestamp() * 1000) + 10**9
    assert _parked_at({"x-death": [death], "x-shardflow-at": later}) == later - 10**9
    assert _parked_at({"x-shardflow-at": later}) == later
    assert _parked_at({"x-shardflow-at": True, "x-death": [{"time": "soon"}]}) is None


def test_submit_wait_says_when_no_orchestrator_consumes_the_programs_shard(
    settings: Settings, tmp_path: Path
) -> None:
    """A `dev --shards 2` beside a client's default 4: `--wait` hung on shards 2 and 3 and
    said nothing. Here no orchestrator runs at all. A --timeout under the 3 s the warning
    waits for brings it forward: it never came before such a wait ran out."""
    program = tmp_path / "p.json"
    program.write_text(json.dumps({"steps": [{"task": "resize"}]}))
    env = environment(settings)
    waited = shardflow("submit", str(program), "--id", "unserved", "--wait", "--timeout", "2",
                       env=env)  # fmt: skip
    assert waited.returncode == 3, waited.stderr
    shards = int(env["SHARDFLOW_SHARDS"])
    assert (
        f"shardflow: warning: no orchestrator consumes shard {shard_for('unserved', shards)} "
        f"(of SHARDFLOW_SHARDS={shards}): the program waits until one does." in waited.stderr
    ), waited.stderr


def test_submit_wait_warns_of_nothing_while_its_program_runs(dev: dict[str, str]) -> None:
    program = json.dumps({"steps": [{"sleep_s": 4}]})
    waited = shardflow("submit", "-", "--wait", "--timeout", "30", env=dev, stdin=program)
    assert waited.returncode == 0, waited.stderr
    assert "warning" not in waited.stderr, waited.stderr


def test_settings_errors_never_carry_the_url_and_cluster_options_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pydantic's own text of a settings error held the whole input (a URL, its password) for
    a program that embeds shardflow; a Redis Cluster's own URL options were refused as no
    connection's."""
    from pydantic import ValidationError

    for variable in ("SHARDFLOW_AMQP_URL", "SHARDFLOW_REDIS_URL", "SHARDFLOW_REDIS_CLUSTER"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValidationError) as caught:
        Settings(amqp_url="amqp://u:[pw-secret]@host/")
    assert "pw-secret" not in str(caught.value)
    with pytest.raises(ValidationError):
        Settings(redis_url="redis://127.0.0.1/0?read_from_replicas=true")
    url = "redis://127.0.0.1/0?read_from_replicas=true"
    assert Settings(redis_cluster=True, redis_url=url).redis_url == url
