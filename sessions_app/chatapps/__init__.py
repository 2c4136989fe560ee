"""Chat-app channels (Telegram, Feishu/Lark): see `base` for the interface every platform
implements and the path its messages take."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatcore.engine.engine import Engine


def start_adapters(engine: Engine) -> None:
    """Start the adapter of every configured platform with a server process's engine
    (`CHAT["ENGINE_SERVICES"]`): its start-up calls and the loop that closes answers a dead
    process left open (D4, C11), as supervised tasks stopped on shutdown."""
    from . import feishu, telegram
    from .base import adapter_for

    if telegram.enabled():
        engine.supervisor.spawn(
            "telegram-start",
            adapter_for(engine, telegram.CHANNEL, telegram.TelegramAdapter),
            daemon=True,
        )
    if feishu.enabled():
        engine.supervisor.spawn(
            "feishu-start", adapter_for(engine, feishu.CHANNEL, feishu.FeishuAdapter), daemon=True
        )
