"""The terminal channel `python manage.py chat`, run as a real subprocess against the fake
model server (E4), including a kill -9 in the middle of an answer (C11)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.fakemodel import FakeModelServer, Reply, user_texts
from tests.procs import embedded_env, manage, migrate_embedded, popen_manage

pytestmark = pytest.mark.slow


@pytest.fixture
def cli_env(tmp_path: Path, fake_model: FakeModelServer) -> dict[str, str]:
    env = embedded_env(tmp_path, LLM_BASE_URL=fake_model.url, CHAT_LEASE_SECONDS="2")
    migrate_embedded(env)
    return env


def test_two_lines_make_two_turns_and_the_second_sees_the_first(cli_env, fake_model):
    # covers: E4, C1, C3
    fake_model.script(Reply(text="first answer"), Reply(text="second answer"))
    done = manage("chat", env=cli_env, stdin="a\nb\n")
    assert done.returncode == 0, done.stderr
    reqs = fake_model.turn_requests()
    assert len(reqs) == 2
    assert user_texts(reqs[0]) == ["a"]
    assert user_texts(reqs[1]) == ["a", "b"]
    assert {"role": "assistant", "content": "first answer"} in reqs[1].messages
    assert done.stdout.index("first answer") < done.stdout.index("second answer")


def test_a_cut_answer_says_so_in_the_terminal(cli_env, fake_model):
    # covers: E4, E5
    fake_model.script(Reply(text="a long ans", finish_reason="length"))
    done = manage("chat", env=cli_env, stdin="tell me\n")
    assert done.returncode == 0, done.stderr
    assert "a long ans\n[The answer was cut off because it reached the length limit." in done.stdout


def test_slash_commands_work_in_the_terminal(cli_env, fake_model):
    # covers: E4, B3
    # The send comes last: a command read while its answer streams prints in the middle of it.
    stdin = "/new Trip plans\n/rename Holiday\n/switch nowhere\n/bogus\n/sessions\nhello\n"
    done = manage("chat", "--dialog-id", "start", env=cli_env, stdin=stdin)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Created dialog" in out and "Trip plans" in out
    assert "Renamed to: Holiday" in out
    assert "does not exist" in out
    assert "Unknown command /bogus" in out
    assert "echo: hello" in out
    assert "Holiday" in out.split("Your dialogs")[1] and "start" in out.split("Your dialogs")[1]
    # Commands never reach the model.
    assert [user_texts(r) for r in fake_model.turn_requests()] == [["hello"]]


def test_bad_dialog_id_is_refused(cli_env):
    # covers: A1, E4
    done = manage("chat", "--dialog-id", "no spaces", env=cli_env, stdin="hi\n")
    assert done.returncode != 0
    assert "Invalid dialog_id" in done.stderr


def test_killed_mid_answer_then_restarted_recovers(cli_env, fake_model, tmp_path):
    # covers: C11, A5
    fake_model.script(Reply(text="half of an answer ", endless=True))
    proc = popen_manage(
        "chat",
        "--dialog-id",
        "d1",
        env=cli_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    proc.stdin.write("tell me everything\nand then this\n")
    proc.stdin.flush()
    db = tmp_path / "chat.sqlite3"
    deadline = time.monotonic() + 30
    partial = ""
    while time.monotonic() < deadline and "half of an answer" not in partial:
        time.sleep(0.1)
        try:
            with sqlite3.connect(db) as conn:
                row = conn.execute(
                    "SELECT partial_text FROM sessions_app_turn WHERE status='running'"
                ).fetchone()
            partial = row[0] if row else ""
        except sqlite3.OperationalError:
            continue
    assert "half of an answer" in partial, "no checkpoint of the partial answer"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)

    # A new terminal on the same chat: closes the dead turn as interrupted with its partial,
    # then the accepted but unstarted send resumes, then the new line runs.
    fake_model.script(Reply(text="resumed answer"), Reply(text="new answer"))
    done = manage("chat", "--dialog-id", "d1", env=cli_env, stdin="one more\n", timeout=60)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        turns = conn.execute(
            "SELECT content, status, error_kind FROM sessions_app_turn ORDER BY number"
        ).fetchall()
        messages = conn.execute(
            "SELECT role, content, status FROM sessions_app_message ORDER BY seq"
        ).fetchall()
    assert turns == [
        ("tell me everything", "failed", "interrupted"),
        ("and then this", "completed", ""),
        ("one more", "completed", ""),
    ]
    interrupted = [m for m in messages if m[2] == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0][1].startswith("half of an answer")
    assert [m[1] for m in messages if m[0] == "user"] == [
        "tell me everything",
        "and then this",
        "one more",
    ]
