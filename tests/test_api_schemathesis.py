"""Property-based fuzzing of the REST API with Schemathesis against a real server (SPEC E3):
whatever the input (valid, invalid, odd Unicode, huge numbers, stateful sequences through the
inferred links), the API never answers with a server error (5xx) and never logs a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakemodel import FakeModelServer, Reply, echo_reply
from tests.test_api_sse import LiveApi, serve_api

pytestmark = pytest.mark.slow

# Bounded so the test stays well under two minutes; raise both to hunt harder locally.
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25"))
SEED = os.environ.get("SCHEMATHESIS_SEED", "20240601")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    model = FakeModelServer().start()
    # Every answer is cut at the length limit, so `continue` has something to go on with.
    model.default = lambda request: Reply(text=echo_reply(request).text, finish_reason="length")
    try:
        # Writes unlimited: a route the fuzzer mostly sees answer 429 (the write budget, F7,
        # spent by the routes before it) would leave its logic untested.
        with serve_api(
            tmp_path_factory.mktemp("fuzz"), model.url, CHAT_WRITE_RATE_PER_MINUTE="1000000"
        ) as server:
            yield server
    finally:
        model.stop()


def test_fuzzed_requests_never_get_a_server_error(live: LiveApi, tmp_path: Path) -> None:
    # covers: E3, F3
    cli = Path(sys.executable).with_name("schemathesis")
    # H1's edit, regenerate and branch name a message by its seq: a generated seq rarely
    # names a user message (an answer, any message) of the dialog a generated case picks, so
    # most of their generated cases are refused as bad input, which is what they must do;
    # edits and regenerates that follow the schema's links from a turn are accepted (202),
    # and tests/test_branches_* cover every outcome. `continue` needs a dialog whose last
    # answer was cut; among the many operations the stateful phase links, few of its cases
    # reach one, so most are answered 404 or 409, which is what they must answer.
    # tests/test_api.py and test_provider_limits.py cover every outcome. The warning about
    # refused generated data is not shown for these four.
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        "[[operations]]\n"
        "include-operation-id-regex = "
        '"^sessions_app_api_(edit_message|regenerate_message|branch_session|continue_session)$"\n'
        "warnings = false\n"
    )
    command = [
        str(cli),
        "--config-file",
        str(config),
        "run",
        f"{live.base}/api/v1/openapi.json",
        "--checks",
        "not_a_server_error",
        "--header",
        f"Authorization: Bearer {live.token}",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        SEED,
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,  # its cache folder (.schemathesis/) stays out of the project
        env={**os.environ, "NO_COLOR": "1"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"schemathesis found problems:\n{output}"
    assert "No issues found" in output, output
    log = live.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log
