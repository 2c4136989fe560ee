"""The operators' admin (SPEC E2): dialogs (`dialogs.py`); messages, turns and memory notes
(`records.py`); API tokens (`tokens.py`); share links (`shares.py`); chat-app accounts and
chats register theirs in `sessions_app/chatapps/admin.py`.
"""

from ..chatapps import admin as chatapps_admin
from . import dialogs, records, shares, tokens

__all__ = ["chatapps_admin", "dialogs", "records", "shares", "tokens"]
