"""The operators' admin (SPEC E2): dialogs (`dialogs.py`); messages, turns and memory notes
(`records.py`); API tokens (`tokens.py`); uploaded files (`files.py`, H3); chat-app accounts
and chats register theirs in `sessions_app/chatapps/admin.py`.
"""

from ..chatapps import admin as chatapps_admin
from . import dialogs, files, records, tokens

__all__ = ["chatapps_admin", "dialogs", "files", "records", "tokens"]
