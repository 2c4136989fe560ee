"""The operators' admin (SPEC E2, H5): dialogs (`dialogs.py`); messages, turns and memory
notes (`records.py`); API tokens (`tokens.py`); uploaded files (`files.py`, H3); share links
(`shares.py`, H2); users, whose flag changes are audited (`users.py`); the "Audit trail" link
of those pages (`history.py`). Chat-app accounts and chats register theirs in
`sessions_app/chatapps/admin.py`.
"""

from ..chatapps import admin as chatapps_admin
from . import dialogs, files, records, shares, tokens, users

__all__ = ["chatapps_admin", "dialogs", "files", "records", "shares", "tokens", "users"]
