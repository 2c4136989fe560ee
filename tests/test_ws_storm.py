"""What a reconnect storm's sockets share (issue 57; SPEC F2, F7, F8): a login looked up once
and reused for a few seconds, yet never past its end (logout or revocation at once, in this
process or another; an unannounced end within the re-check); token lookups made together in
one statement; the per-user socket bound registered a pipeline per batch on Redis; and the
sockets of a user opening together read their list once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.test import Client, override_settings
from django.utils import timezone

from sessions_app import auth, login_cache, logins, services
from sessions_app.models import ApiToken
from tests.engine_helpers import make_dialog
from tests.test_ws_auth import session_cookie
from tests.ws_helpers import WS, assert_closed_unauthenticated, bearer, chat_cfg, open_ws

pytestmark = [pytest.mark.django_db(transaction=True)]

COOKIE_HEADERS = [(b"host", b"testserver"), (b"origin", b"http://testserver")]


async def opened(headers: list[tuple[bytes, bytes]]) -> WS:
    ws, connected = await open_ws(headers)
    assert connected
    assert (await ws.next())["type"] == "sessions"
    assert (await ws.next())["type"] == "session_history"
    return ws


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tokens each lookup statement read (alone or gathered)."""
    seen: list[int] = []
    many, one = auth.tokens_for_raw, auth.token_for_raw

    def counted_many(raws: list[str]) -> list[Any]:
        seen.append(len(raws))
        return many(raws)

    def counted_one(raw: str | None) -> Any:
        seen.append(1)
        return one(raw)

    from sessions_app import ws_auth

    monkeypatch.setattr(ws_auth, "tokens_for_raw", counted_many)
    monkeypatch.setattr(ws_auth, "token_for_raw", counted_one)
    return seen


async def test_a_token_found_is_reused_until_it_is_revoked(
    engine: Any, user: Any, lookups: list[int]
) -> None:
    # covers: F2, F8 (looked up once for a storm of its sockets; revocation ends it at once)
    headers = await bearer(user)
    sockets = [await opened(headers) for _ in range(3)]
    assert lookups == [1]
    token = await sync_to_async(ApiToken.objects.get)(user=user)
    await sync_to_async(services.api_token_revoke)(token=token)
    for ws in sockets:
        assert await ws.comm.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}
    refused, _ = await open_ws(headers)
    await assert_closed_unauthenticated(refused)
    assert lookups == [1, 1]  # looked up again, not taken from what was kept


async def test_a_token_revoked_unannounced_ends_within_the_recheck(
    engine: Any, user: Any, lookups: list[int]
) -> None:
    # covers: F8 (a bulk update fires no signal: the kept lookup lasts its seconds, and a
    # socket opened on it is closed by the periodic re-check)
    headers = await bearer(user)
    with chat_cfg(LOGIN_CHECK_SECONDS=0.2, LOGIN_CACHE_SECONDS=60):
        first = await opened(headers)
        await sync_to_async(
            lambda: ApiToken.objects.filter(user=user).update(revoked_at=timezone.now())
        )()
        second, _ = await open_ws(headers)  # accepted on the kept lookup...
        for ws in (first, second):
            closed = None
            for _ in range(20):  # ...and closed, with the first, within the re-check
                output = await ws.comm.receive_output(timeout=5)
                if output["type"] == "websocket.close":
                    closed = output
                    break
            assert closed == {"type": "websocket.close", "code": 4401}
    assert lookups == [1]


async def test_a_login_ended_in_another_process_is_not_reused(engine: Any, user: Any) -> None:
    # covers: F8 (another process's logout reaches this one's socket of that login, which
    # drops the kept lookup)
    cookie = await session_cookie(user)
    ws = await opened([(b"cookie", cookie), *COOKIE_HEADERS])
    key = cookie.decode().split("=", 1)[1]
    assert login_cache.cache().get(login_cache.session_key_of(key)) is not None
    # What `end_logins` sends to the session's group on commit, from elsewhere.
    await get_channel_layer().group_send(logins.session_group(key), {"type": logins.LOGIN_ENDED})
    assert await ws.comm.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}
    assert login_cache.cache().get(login_cache.session_key_of(key)) is None


async def test_a_logout_refuses_the_next_cookie_socket_at_once(engine: Any, user: Any) -> None:
    # covers: F8
    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    await opened([(b"cookie", cookie), *COOKIE_HEADERS])
    await sync_to_async(client.logout)()
    refused, _ = await open_ws([(b"cookie", cookie), *COOKIE_HEADERS])
    await assert_closed_unauthenticated(refused)


async def test_tokens_of_sockets_opening_together_are_read_in_one_statement(
    engine: Any, make_user: Any, lookups: list[int]
) -> None:
    # covers: F7 (a storm of different logins: a few statements, not one each)
    users = [await sync_to_async(make_user)() for _ in range(12)]
    headers = [await bearer(u) for u in users]
    sockets = await asyncio.gather(*(opened(h) for h in headers))
    assert sum(lookups) == 12 and len(lookups) < 12
    for ws in sockets:
        await ws.close()


async def test_the_sockets_of_one_login_opening_together_look_it_up_once(
    engine: Any, user: Any, lookups: list[int]
) -> None:
    # covers: F2, F7 (every tab of a user back at once after a restart: the first socket's
    # lookup serves the others, which wait for it rather than each reading the token)
    headers = await bearer(user)
    sockets = await asyncio.gather(*(opened(headers) for _ in range(8)))
    assert lookups == [1]
    for ws in sockets:
        await ws.close()


async def test_the_sockets_of_a_user_opening_together_read_their_list_once(
    engine: Any, user: Any
) -> None:
    # covers: F7 (one list read for a burst of one user's sockets)
    await make_dialog(user, "alpha")
    headers = await bearer(user)
    sockets = await asyncio.gather(*(opened(headers) for _ in range(6)))
    assert engine.openings.lists.reads == 1
    for ws in sockets:
        await ws.close()


@pytest.mark.redis
def test_a_batch_of_sockets_is_counted_in_one_pipeline(redis_url: str) -> None:
    # covers: F7, G1 (the bound holds within a batch and across processes)
    import redis

    from chatcore.engine.limits import SocketRegistry

    redis.Redis.from_url(redis_url).delete("ws:user:515151", "ws:user:515152")
    with override_settings(SCALED=True, REDIS_URL=redis_url):
        one, two = SocketRegistry(), SocketRegistry()
        assert one.open(515151, "a0", 3)
        items = [(515151, "a1", 3), (515152, "b1", 3), (515151, "a2", 3), (515151, "a3", 3)]
        assert two.open_many(items) == [True, True, True, False]
        assert not one.open(515151, "a4", 3)  # the refused one was not left counted
        two.close(515151, "a1")
        assert one.open(515151, "a4", 3)
    redis.Redis.from_url(redis_url).delete("ws:user:515151", "ws:user:515152")


def test_what_a_client_says_it_holds_is_read_from_its_url() -> None:
    # covers: D2 (PROTOCOL "On connect": the query parameters; what does not parse is not said)
    import uuid

    from chatcore.engine.opening import Holds

    mine = str(uuid.uuid4())
    said = Holds.from_query(
        f"dialog_id=d1&since=7&last_id={mine}&sessions_etag=ab12&since=9".encode()
    )
    assert said == Holds(dialog_id="d1", since=7, last_id=mine, sessions_etag="ab12")
    assert Holds.from_query(b"") == Holds()
    assert Holds.from_query(b"dialog_id=d%2Ex&since=-1&last_id=nope") == Holds(dialog_id="d.x")
    hex_form = f"last_id={mine.replace('-', '')}".encode()  # normalised to the frames' form
    assert Holds.from_query(hex_form) == Holds(last_id=mine)
    assert Holds.from_query(b"sessions_etag=" + b"x" * 65).sessions_etag is None
