"""Files sent in a chat app (SPEC H3): a Telegram photo or document, a Feishu image or file,
fetched through the platform's download method and stored as an upload of the dialog's
owner (who reads the dialog, on the web too once linked), then attached to the message like
a web upload.

A download is streamed into a temporary file (memory does not grow with it) and stops at
`CHAT_UPLOAD_MAX_BYTES`; the file's kind comes from its bytes (`file_kinds`). Every refusal
(too large, unsupported, unreadable, the platform not giving the file) is a `ChatError`
answered in the chat, and nothing is stored.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import IO, Any

import httpx
from asgiref.sync import sync_to_async
from django.utils.translation import gettext as _

from chatcore.common.dbthreads import on_db
from chatcore.common.errors import BadRequest

from .. import files

# Downloads stay in memory up to this size, then go to disk.
SPOOL_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PlatformMedia:
    """A file of a platform message: the platform's id or key for it, its name, and its size
    when the platform says it."""

    key: str
    name: str
    size: int | None = None
    # The platform's own word for it (Feishu's resource `type`: image or file).
    kind: str = "file"


def unavailable() -> BadRequest:
    return BadRequest(_("The file could not be fetched from the chat app; send it again."))


async def download(http: httpx.AsyncClient, url: str, **request: Any) -> tuple[IO[bytes], int]:
    """GET `url` into a temporary file, at most CHAT_UPLOAD_MAX_BYTES; the file (rewound)
    and its size."""
    limit = files.upload_limit()
    out = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - returned
    size = 0
    try:
        async with http.stream("GET", url, **request) as response:
            if response.status_code != 200:
                raise unavailable()
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise files.too_large()
                out.write(chunk)
    except httpx.HTTPError:
        out.close()
        raise unavailable() from None
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out, size


async def store_all(client: Any, message: Any, *, owner_id: int) -> list[dict[str, Any]]:
    """Fetch and store the files of `message` for `owner_id`; their refs, as the message
    will carry them. `client.download(message, media)` is the platform's download."""
    refs: list[dict[str, Any]] = []
    for media in message.media:
        if media.size is not None and media.size > files.upload_limit():
            raise files.too_large()
        stream, size = await client.download(message, media)
        try:
            stored = await sync_to_async(files.file_store_bytes, thread_sensitive=False)(
                stream=stream, name=media.name, size=size
            )
        finally:
            stream.close()
        row = await on_db(files.file_create)(owner_id=owner_id, stored=stored)
        refs.append(row.as_ref())
    return refs
