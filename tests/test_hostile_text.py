"""Text a sender controls, in what shardflow logs and prints: refusal reasons (a key or a value
of the refused document), a failed program's error, names and cursors in `explain`. None may
carry a line break, a terminal escape or a bidi override raw: the first forges log lines, the
others act on the operator's terminal (OSC 52 writes the clipboard)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.connections import connected
from orchestrator.delivery import describe, process
from orchestrator.documents import ProgramError
from orchestrator.messages import MessageError, decode_shard_body
from orchestrator.program import parse_program
from orchestrator.settings import Settings
from router.explain import _waiting_for, explain_text
from router.listing import clean
from shardflow import cli

# A forged log line after a screen clear, a clipboard write, and what a log reader, an editor
# or a terminal also takes for a line break or a change of direction.
E = (
    "\x1b]52;c;SGVsbG8=\x07\x1b[2J\r\n"
    "2026-12-05 10:00:00,000 CRITICAL orchestrator.owner: REDIS COMPROMISED"
    "\x85\u2028\u2029\u202etxt.exe\u2066"
)


def unsafe(text: str) -> list[str]:
    return [ch for ch in text if not ch.isprintable()]


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "start", "wf": "a", E: 1},  # an unknown key
        {"kind": E, "wf": "a"},  # a tag pydantic repeats in its message
        [{"kind": "next", "wf": "a", "path": "0", E: 1}],  # in a bundle
        {"kind": "start", "wf": "a", "k" * 100_000: 1},  # a key as long as a body allows
    ],
    ids=["key", "kind", "bundle", "long key"],
)
def test_a_shard_messages_refusal_reason_holds_no_control_character(body: Any) -> None:
    with pytest.raises(MessageError) as caught:
        decode_shard_body(json.dumps(body).encode())
    reason = str(caught.value)
    assert not unsafe(reason), reason
    assert len(reason) < 500, reason[:500]
    assert not unsafe(describe(caught.value))


def test_an_ordinary_key_reads_as_it_is_in_a_reason() -> None:
    with pytest.raises(MessageError) as caught:
        decode_shard_body(b'{"kind": "start", "wf": "a", "junk": 1}')
    assert str(caught.value) == "start.junk: Extra inputs are not permitted"
    with pytest.raises(MessageError) as caught:
        decode_shard_body(b'{"kind": "start", "wf": "a", "\\u001b": 1}')
    assert str(caught.value) == "start.'\\x1b': Extra inputs are not permitted"
    with pytest.raises(ProgramError) as refused:
        parse_program({"steps": [{"task": "a", "junk": 1}]})
    assert str(refused.value) == "steps[0].junk: Extra inputs are not permitted"


@pytest.mark.parametrize(
    "program",
    [
        {"steps": [{"task": "a", E: 1}]},
        {"steps": [{"task": "a", "args": {E: 1}, "args_from": {E: "input.x"}}]},
        {"steps": [{"task": "a", "args_from": {E: "steps.nope.x"}}]},
        {"steps": [{"bag": [{"task": "a", "args_from": {E: "steps.nope.x"}}]}]},
        {"steps": [{"until": "1 +\n" + E, "max_iterations": 2, "steps": [{"task": "a"}]}]},
    ],
    ids=["key", "args and args_from", "unknown step", "bag member", "cel"],
)
def test_a_programs_faults_hold_no_control_character(program: dict[str, Any]) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_program(json.dumps(program))
    assert caught.value.faults
    for fault in caught.value.faults:
        assert not unsafe(fault), fault


def test_any_refusal_reason_is_escaped_before_it_is_parked() -> None:
    assert not unsafe(describe(ValueError("x" + E)))


@dataclass
class Held:
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    redelivered: bool | None = False
    priority: int | None = 0
    settled: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, *, requeue: bool = True) -> None:
        self.settled.append("nack")


async def test_a_refusal_is_logged_on_one_line_and_parked_with_a_safe_reason(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="orchestrator.bus")
    body = json.dumps({"kind": "start", "wf": "a", E: 1}).encode()
    async with connected(settings) as (_, bus):
        held = Held(body)
        async with process(held, bus, "q", poison=(MessageError,)):
            decode_shard_body(body)
        assert held.settled == ["ack"]
        # The log escapes what a reason holds, whoever wrote it.
        await bus.dead_letter(b"{}", reason="raw" + E, source="q")
        parked = await bus.peek_dead(10)
    logged = [r.getMessage() for r in caplog.records if r.name == "orchestrator.bus"]
    assert len(logged) == 2
    for line in logged:
        assert not unsafe(line), line
    assert "COMPROMISED" in logged[1]  # escaped, not dropped
    reason = parked[0][0]["x-shardflow-reason"]
    assert reason.endswith(": Extra inputs are not permitted") and not unsafe(reason), reason


EVIL = (
    "disk full\x1b]52;c;ZWNobyBwd25lZAo=\x07\x1b[2K\r\x1b[32mprogram completed\x1b[0m\n"
    "\u202etxt.exe"
)


def test_submit_wait_prints_a_failed_programs_error_escaped(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    program = tmp_path / "evil.json"
    program.write_text('{"steps": [{"task": "evil"}]}')

    class Router:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def submit(self, *args: Any) -> Any:
            return SimpleNamespace(workflow_id="evil-1", created=True, status="pending")

        async def wait(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            error = f"step 0: task 'evil': RuntimeError: {EVIL}"
            return {"status": "failed", "error": error, "compensations": {"error": EVIL}}

    @contextlib.asynccontextmanager
    async def services(*args: Any) -> AsyncIterator[tuple[None, None]]:
        yield None, None

    monkeypatch.setattr(cli, "Router", Router)
    monkeypatch.setattr(cli, "connected", services)
    with pytest.raises(SystemExit) as exited:
        cli.main(["submit", str(program), "--wait"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert not unsafe(err.replace("\n", "")), err
    lines = err.splitlines()
    assert lines[0] == "evil-1" and len(lines) == 2, lines
    assert lines[1].startswith(
        "shardflow: program failed: step 0: task 'evil': RuntimeError: disk full\\x1b]52;c;"
    )
    assert lines[1].endswith("; disk full\\x1b]52;c;ZWNobyBwd25lZAo=\\x07\\x1b[2K\\r\\x1b[32m"
                             "program completed\\x1b[0m\\n\\u202etxt.exe")  # fmt: skip


@pytest.mark.parametrize(
    "ch",
    ["\x1b", "\n", "\r", "\x85", "\u2028", "\u2029", "\u202a", "\u202e", "\u2066", "\u2069"],
)
def test_clean_escapes_line_breaks_and_direction_changes(ch: str) -> None:
    assert clean(f"a{ch}b") == "a" + repr(ch)[1:-1] + "b"
    assert clean("café 名前 a b") == "café 名前 a b"


def test_explain_quotes_what_it_escaped_once() -> None:
    report = {
        "workflow_id": "w",
        "name": "nightly\x1b[31m",
        "status": "running",
        "created_ms": None,
        "error": None,
        "step": None,
        "waiting_for": "x",
        "pool": None,
        "retry_queue": None,
        "lane": {
            "held": True,
            "this_program": False,
            "workflow_id": "other",
            "path": "0",
            "task": clean("t\x1b[2J"),
            "since_ms": 0,
        },
        "shard": None,
        "deadline": None,
    }
    text = explain_text(report, now_ms=0)
    assert text.startswith("Program w 'nightly\\x1b[31m' is running.")
    assert "task 't\\x1b[2J')" in text
    assert "\\\\" not in text and "\x1b" not in text
    waiting = _waiting_for({"status": "running", "shard": {}, "step": None}, cursor="0\x1b", now=0)
    assert waiting == "nothing it can name: its cursor '0\\x1b' is not a step of its plan"
