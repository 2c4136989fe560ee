"""Running scaled mode as documented (README "Scaled mode"): `make run-scaled` refuses to
start without PostgreSQL and Redis, and starts two servers, a worker and beat under honcho
when they answer; `deploy/nginx.conf` in front of two `serve` processes passes WebSocket and
SSE turns through, streaming, to both of them (SPEC G1, E3)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessions_app import services
from tests.conftest import IN_CI
from tests.fakemodel import FakeModelServer, Reply
from tests.procs import ROOT, free_port
from tests.scaled import Api, Cluster, RedisServer, Socket, require_scaled_services, wait_until
from tests.test_api_sse import sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def make(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_run_scaled_refuses_to_start_without_its_services() -> None:
    # covers: G (README "Scaled mode": a clear error, nothing started)
    env = {**os.environ, "DATABASE_URL": "", "REDIS_URL": ""}
    done = make("run-scaled", env=env)
    assert done.returncode != 0
    assert "DATABASE_URL is not set" in done.stderr
    assert "REDIS_URL is not set" in done.stderr
    assert "honcho" not in done.stdout

    closed = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://nobody:secret@127.0.0.1:{closed}/chat",
        "REDIS_URL": f"redis://127.0.0.1:{closed}/0",
    }
    done = make("run-scaled", env=env)
    assert done.returncode != 0
    assert f"PostgreSQL at postgres://***@127.0.0.1:{closed}/chat does not answer" in done.stderr
    assert f"Redis at redis://127.0.0.1:{closed}/0 does not answer" in done.stderr
    assert "secret" not in done.stderr + done.stdout

    env["DATABASE_URL"] = "sqlite:///" + str(ROOT / "var" / "never.sqlite3")
    done = make("scaled-check", env=env)
    assert done.returncode != 0 and "not PostgreSQL" in done.stderr


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_run_scaled_starts_two_servers_a_worker_and_beat(
    tmp_path: Path, fake_model: FakeModelServer, user: Any
) -> None:
    # covers: G (make run-scaled), G1, G4
    require_scaled_services()
    redis_server = RedisServer(tmp_path / "redis").start()
    ports = free_port(), free_port()
    cluster = Cluster(tmp_path, model_url=fake_model.url, redis_server=redis_server)
    env = {
        **cluster.env,
        "SERVE_PORT_1": str(ports[0]),
        "SERVE_PORT_2": str(ports[1]),
        "WORKER_CONCURRENCY": "1",
        "CHAT_VAR_DIR": str(tmp_path),
    }
    log = (tmp_path / "honcho.log").open("w")
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "run-scaled"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:

        def up() -> bool:
            text = (tmp_path / "honcho.log").read_text()
            assert proc.poll() is None, text
            return all(f"Serving on http://127.0.0.1:{p}" in text for p in ports) and (
                "ready." in text and "beat: Starting" in text
            )

        wait_until(up, timeout=90, what="two servers, a worker and beat")
        _token, raw = services.api_token_issue(user=user)
        one, two = (Api(f"http://127.0.0.1:{p}", raw) for p in ports)
        sid = one.create_dialog(channel="api", chat_id=f"u{user.pk}", dialog_id="honcho")
        turn = two.send(sid, "hello from the second server")
        assert one.wait_turn(turn)["status"] == "completed"
    finally:
        # Ctrl-C stops them all (honcho passes it on).
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        redis_server.stop()
    for p in ports:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=2)


# --- deploy/nginx.conf ----------------------------------------------------------------------


class Nginx:
    """Debian's nginx on a free port with deploy/nginx.conf, its upstreams pointed at the
    test's servers; only paths (pid, logs, temp files) and ports differ from the template."""

    def __init__(self, workdir: Path, upstream_ports: list[int]) -> None:
        self.workdir = workdir
        self.port = free_port()
        template = (ROOT / "deploy" / "nginx.conf").read_text()
        servers = re.findall(r"server 127\.0\.0\.1:(\d+)", template)
        assert len(servers) == 2 and len(upstream_ports) == 2
        conf = template.replace("listen 8080;", f"listen 127.0.0.1:{self.port};")
        for old, new in zip(servers, upstream_ports, strict=True):
            conf = conf.replace(f"server 127.0.0.1:{old} ", f"server 127.0.0.1:{new} ")
        w = str(workdir)
        conf = (
            f"daemon off;\nmaster_process off;\npid {w}/nginx.pid;\nerror_log {w}/error.log;\n"
            + conf.replace(
                "http {\n",
                "http {\n"
                f"    access_log {w}/access.log;\n"
                f"    client_body_temp_path {w}/body;\n    proxy_temp_path {w}/proxy;\n"
                f"    fastcgi_temp_path {w}/fastcgi;\n    uwsgi_temp_path {w}/uwsgi;\n"
                f"    scgi_temp_path {w}/scgi;\n",
                1,
            )
        )
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(conf)
        self.proc: subprocess.Popen[str] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        args = [NGINX, "-e", str(self.workdir / "error.log"), "-p", str(self.workdir)]
        checked = subprocess.run(
            [*args, "-t", "-c", str(self.conf)], capture_output=True, text=True, check=False
        )
        assert checked.returncode == 0, checked.stderr
        self.proc = subprocess.Popen([*args, "-c", str(self.conf)], text=True)
        try:
            wait_until(self._answers, timeout=20, what="nginx")
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "nginx exited"
        try:
            return httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def nginx_binary() -> str:
    if not os.path.exists(NGINX):
        reason = "nginx is not installed (apt-get install nginx)"
        if IN_CI:
            pytest.fail(reason + "; CI must run this test")
        pytest.skip(reason)
    return NGINX


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_nginx_streams_websocket_and_sse_turns_to_both_processes(
    nginx_binary: str, tmp_path: Path, fake_model: FakeModelServer, user: Any
) -> None:
    # covers: G1, E3, D1 (deploy/nginx.conf: WebSocket upgrade, SSE unbuffered, two upstreams)
    require_scaled_services()
    redis_server = RedisServer(tmp_path / "redis").start()
    cluster = Cluster(tmp_path, model_url=fake_model.url, redis_server=redis_server)
    proxy: Nginx | None = None
    try:
        servers = [cluster.serve("a"), cluster.serve("b")]
        proxy = Nginx(tmp_path, [s.port for s in servers]).start()
        _token, raw = services.api_token_issue(user=user)
        api = Api(proxy.base, raw)
        sid = api.create_dialog(channel="web", chat_id=f"u{user.pk}", dialog_id="proxied")
        upstreams = {f"127.0.0.1:{s.port}" for s in servers}

        # WebSockets: connect until both processes hold one; each streams a turn.
        sockets: dict[str, Socket] = {}
        for _ in range(8):
            sock = Socket(proxy.base, raw, "proxied")
            sock.wait_for(lambda f: f["type"] == "session_history")
            if sock.upstream in sockets or sock.upstream not in upstreams:
                sock.close()
                continue
            sockets[sock.upstream] = sock
            if len(sockets) == 2:
                break
        assert set(sockets) == upstreams, f"WebSockets reached {set(sockets)}"
        for n, (upstream, sock) in enumerate(sockets.items()):
            gate = threading.Event()
            fake_model.script(Reply(text=f"streamed answer {n}", chunk=3, gate=gate))
            sock.send(type="send", content=f"via {upstream}", client_msg_id=f"ws-{n}")
            turn_id = sock.wait_for(lambda f, n=n: f.get("client_msg_id") == f"ws-{n}")["turn_id"]
            # The answer streams before the model has finished (nothing buffers it).
            for each in sockets.values():
                each.wait_for(
                    lambda f, t=turn_id: f["type"] == "turn_snapshot" and f["turn_id"] == t
                )
            gate.set()
            for each in sockets.values():
                assert each.terminal(turn_id)["status"] == "completed"

        # SSE: POST streams until both processes answered one; each streams its turn.
        seen: set[str] = set()
        for n in range(8):
            gate = threading.Event()
            fake_model.script(Reply(text=f"sse answer {n}", chunk=3, gate=gate))
            with api.client.stream(
                "POST",
                f"/sessions/{sid}/messages",
                json={"content": f"sse {n}"},
                headers={"Accept": "text/event-stream"},
            ) as response:
                assert response.status_code == 200, response.read()
                upstream = response.headers.get("X-Upstream", "")
                kinds = []
                for event in sse_events(response.iter_lines()):
                    kinds.append(event["event"])
                    if event["event"] == "turn_snapshot":
                        gate.set()  # it arrived while the model still held the answer back
                    if event["event"] == "turn_updated":
                        assert event["data"]["status"] == "completed"
                        break
            assert kinds[0] == "queued" and "turn_snapshot" in kinds, kinds
            seen.add(upstream)
            if seen == upstreams:
                break
        assert seen == upstreams, f"SSE reached {seen}"
        for sock in sockets.values():
            sock.close()
    finally:
        if proxy is not None:
            proxy.stop()
        cluster.stop()
        redis_server.stop()
