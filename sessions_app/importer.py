"""Import of a dialog (SPEC H2, PROTOCOL "Search, export, import"): our `chatcore.dialog.v1`
JSON, or one conversation of a ChatGPT data export (`mapping` of nodes with `parent` and
`children`, `current_node`).

The document is read and checked whole first (`parse_document`): any problem raises
`InvalidDocument` naming the first one, before anything is written. Then one transaction
(`import_writes.dialog_import`) writes a new dialog of the caller in their web chat (fresh
ids) with its messages, and the row's counters as the engine keeps them (A2, A3):
`last_seq` (the history revision) = the last seq, `total_message_count` = the messages,
`message_count` = the user's own; token counts are the engine's to make, per message, when
a turn first reads them.

Branches: a document is read as the tree it is (`ImportedDialog`: every message of every
branch after its parent, and the head: in our JSON `head_seq`, in a ChatGPT conversation
`current_node`), and stored as one: every branch, the head the document's (H1).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _

from chatcore.common.errors import ChatError, TooLarge
from chatcore.common.ids import storable_text

from .export import FORMAT
from .models import MessageKind, MessageStatus, Role
from .services import TITLE_MAX

ROLES = {r.value for r in Role}
STATUSES = {s.value for s in MessageStatus}
KINDS = {k.value for k in MessageKind}
DEFAULT_KIND = {
    "user": MessageKind.USER_INPUT,
    "assistant": MessageKind.ASSISTANT,
    "tool": MessageKind.TOOL_RESULT,
    "system": MessageKind.WELCOME,
}
# ChatGPT's authors; its `tool` and `system` nodes (browsing, code runs, hidden context) have
# no tool call to pair with here, so only what the user and the assistant wrote comes in.
CHATGPT_ROLES = {"user", "assistant"}


class InvalidDocument(ChatError):
    """A document that cannot be imported; the message names the first problem."""

    code = "bad_request"
    http_status = 400


@dataclass(slots=True)
class ImportedMessage:
    role: str
    content: str
    created_at: datetime | None
    kind: str
    status: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str = ""
    tool_name: str = ""
    media_refs: list[Any] = field(default_factory=list)
    # The index (in `ImportedDialog.messages`) of the message this one follows; None: first.
    parent: int | None = None


@dataclass(slots=True)
class ImportedDialog:
    """Every message of every branch, each after its parent, and the active path's last
    (`head`, an index; None for no message)."""

    title: str | None
    created_at: datetime | None
    messages: list[ImportedMessage]
    head: int | None = None

    def active_path(self) -> list[ImportedMessage]:
        path: list[ImportedMessage] = []
        index = self.head
        while index is not None:
            path.append(self.messages[index])
            index = self.messages[index].parent
        path.reverse()
        return path


def max_bytes() -> int:
    return int(settings.CHAT["IMPORT_MAX_BYTES"])


def max_messages() -> int:
    return int(settings.CHAT["IMPORT_MAX_MESSAGES"])


def too_large_message() -> str:
    return _("The document is larger than %(n)d bytes.") % {"n": max_bytes()}


# --- Reading and checking -------------------------------------------------------------------


def parse_bytes(raw: bytes) -> ImportedDialog:
    """The body of `POST /sessions/import`: size, JSON, then `parse_document`."""
    if len(raw) > max_bytes():
        raise TooLarge(too_large_message())
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidDocument(
            _("The document is not valid JSON: %(error)s") % {"error": exc}
        ) from exc
    if isinstance(document, list):
        if len(document) != 1:
            raise InvalidDocument(
                _(
                    "This holds %(n)d conversations; import one at a time here, or a whole "
                    "export with manage.py import_dialogs."
                )
                % {"n": len(document)}
            )
        document = document[0]
    return parse_document(document)


def parse_document(document: Any) -> ImportedDialog:
    if not isinstance(document, dict):
        raise InvalidDocument(_("The document must be a JSON object."))
    if document.get("format") == FORMAT:
        return _ours(document)
    if "mapping" in document:
        return _chatgpt(document, where="")
    if "format" in document:
        raise InvalidDocument(
            _("Unknown format %(format)r (expected %(expected)s).")
            % {"format": str(document["format"])[:60], "expected": FORMAT}
        )
    raise InvalidDocument(
        _("Not a dialog: expected a %(format)s document or a ChatGPT conversation (mapping).")
        % {"format": FORMAT}
    )


def _title(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str) or not storable_text(value):
        raise InvalidDocument(_("%(where)stitle must be text.") % {"where": where})
    return " ".join(value.split())[:TITLE_MAX]


def _time(value: Any, where: str) -> datetime | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, int | float):
            return datetime.fromtimestamp(float(value), tz=UTC)
        if isinstance(value, str):
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        raise TypeError
    except (TypeError, ValueError, OverflowError, OSError) as exc:
        raise InvalidDocument(
            _("%(where)s: created_at is not a time: %(value)r")
            % {"where": where, "value": str(value)[:40]}
        ) from exc


def _text(value: Any, where: str, name: str = "content") -> str:
    if not isinstance(value, str):
        raise InvalidDocument(
            _("%(where)s: %(name)s must be text.") % {"where": where, "name": name}
        )
    if not storable_text(value):
        raise InvalidDocument(
            _("%(where)s: %(name)s holds characters that cannot be stored.")
            % {"where": where, "name": name}
        )
    return value


def _count_check(n: int) -> None:
    if n > max_messages():
        raise InvalidDocument(
            _("The dialog has %(n)d messages; at most %(max)d can be imported.")
            % {"n": n, "max": max_messages()}
        )


def _ours(document: dict[str, Any]) -> ImportedDialog:
    raw_messages = document.get("messages")
    if not isinstance(raw_messages, list):
        raise InvalidDocument(_("messages: missing, or not a list."))
    _count_check(len(raw_messages))
    by_seq: dict[int, dict[str, Any]] = {}
    for index, item in enumerate(raw_messages):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise InvalidDocument(_("%(where)s: not an object.") % {"where": where})
        for name in ("seq", "role", "content"):
            if name not in item:
                raise InvalidDocument(
                    _("%(where)s: %(name)s is missing.") % {"where": where, "name": name}
                )
        seq = item["seq"]
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise InvalidDocument(
                _("%(where)s: seq must be a positive integer.") % {"where": where}
            )
        if seq in by_seq:
            raise InvalidDocument(
                _("%(where)s: seq %(seq)d appears twice.") % {"where": where, "seq": seq}
            )
        parent = item.get("parent_seq")
        if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int)):
            raise InvalidDocument(
                _("%(where)s: parent_seq must be a seq or null.") % {"where": where}
            )
        by_seq[seq] = {**item, "_where": where}
    # A message without `parent_seq` follows the one before it by seq (a document written
    # as one line); `null` makes it a first message.
    previous: int | None = None
    for seq in sorted(by_seq):
        by_seq[seq].setdefault("parent_seq", previous)
        previous = seq
    for item in by_seq.values():
        parent = item.get("parent_seq")
        if parent is not None and parent not in by_seq:
            raise InvalidDocument(
                _("%(where)s: parent_seq %(parent)d is not a message of the dialog.")
                % {"where": item["_where"], "parent": parent}
            )
    head = document.get("head_seq")
    if head is None and by_seq:
        head = max(by_seq)
    if head is not None and (
        not isinstance(head, int) or isinstance(head, bool) or head not in by_seq
    ):
        raise InvalidDocument(_("head_seq is not a message of the dialog."))
    parents = {seq: item.get("parent_seq") for seq, item in by_seq.items()}
    _acyclic(parents, where="parent_seq")
    checked: dict[Any, ImportedMessage | None] = {
        seq: _our_message(item) for seq, item in by_seq.items()
    }
    messages, head_index = _tree(checked, parents, head, order=lambda seq: seq)
    return ImportedDialog(
        title=_title(document.get("title"), ""),
        created_at=_time(document.get("created_at"), "created_at"),
        messages=messages,
        head=head_index,
    )


def _acyclic(parents: dict[Any, Any], *, where: str) -> None:
    """Every chain of parents ends at a first message; a cycle is an error, named by a
    node on it."""
    done: set[Any] = set()
    for start in parents:
        walk: set[Any] = set()
        node = start
        while node is not None and node not in done:
            if node in walk:
                raise InvalidDocument(
                    _("%(where)s: the messages form a cycle at %(node)s.")
                    % {"where": where, "node": str(node)[:60]}
                )
            walk.add(node)
            node = parents[node]
        done |= walk


def _tree(
    checked: dict[Any, ImportedMessage | None],
    parents: dict[Any, Any],
    head: Any,
    *,
    order: Callable[[Any], Any],
) -> tuple[list[ImportedMessage], int | None]:
    """The messages kept (`checked` values not None), each after its parent, each child's
    `parent` the index of its nearest kept ancestor; siblings oldest first by `order`. And
    the index of the head's nearest kept node (itself or an ancestor)."""
    kept_of: dict[Any, Any] = {}

    def nearest(node: Any) -> Any:
        chain = []
        while node is not None and node not in kept_of and checked[node] is None:
            chain.append(node)
            node = parents[node]
        found = kept_of.get(node, node) if node is not None else None
        for passed in chain:
            kept_of[passed] = found
        return found

    children: dict[Any, list[Any]] = {}
    for node, message in checked.items():
        if message is not None:
            children.setdefault(nearest(parents[node]), []).append(node)
    messages: list[ImportedMessage] = []
    index: dict[Any, int] = {}
    waiting = [(order(node), n, node) for n, node in enumerate(children.get(None, []))]
    heapq.heapify(waiting)
    tie = len(waiting)
    while waiting:
        _key, _n, node = heapq.heappop(waiting)
        message = checked[node]
        assert message is not None
        up = nearest(parents[node])
        message.parent = index[up] if up is not None else None
        index[node] = len(messages)
        messages.append(message)
        for child in children.get(node, []):
            tie += 1
            heapq.heappush(waiting, (order(child), tie, child))
    top = nearest(head) if head is not None and checked.get(head) is None else head
    return messages, index.get(top) if top is not None else None


def _our_message(item: dict[str, Any]) -> ImportedMessage:
    where = item["_where"]
    role = item["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidDocument(
            _("%(where)s: role %(role)r is not one of %(roles)s.")
            % {"where": where, "role": str(role)[:20], "roles": ", ".join(sorted(ROLES))}
        )
    kind = item.get("kind") or DEFAULT_KIND[role]
    if not isinstance(kind, str) or kind not in KINDS:
        raise InvalidDocument(
            _("%(where)s: unknown kind %(kind)r.") % {"where": where, "kind": str(kind)[:20]}
        )
    status = item.get("status") or ""
    if not isinstance(status, str) or status not in STATUSES:
        raise InvalidDocument(
            _("%(where)s: unknown status %(status)r.")
            % {"where": where, "status": str(status)[:20]}
        )
    tool_calls = item.get("tool_calls")
    if tool_calls is not None and (
        not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls)
    ):
        raise InvalidDocument(
            _("%(where)s: tool_calls must be a list of objects.") % {"where": where}
        )
    attachments = item.get("attachments") or []
    if not isinstance(attachments, list) or not all(
        isinstance(a, dict) and isinstance(a.get("file_id"), str) for a in attachments
    ):
        raise InvalidDocument(
            _("%(where)s: attachments must be a list of objects with a file_id.") % {"where": where}
        )
    return ImportedMessage(
        role=role,
        content=_text(item["content"], where),
        created_at=_time(item.get("created_at"), where),
        kind=kind,
        status=status,
        tool_calls=tool_calls or None,
        tool_call_id=_text(item.get("tool_call_id") or "", where, "tool_call_id")[:128],
        tool_name=_text(item.get("tool_name") or "", where, "tool_name")[:128],
        media_refs=attachments,
    )


def _chatgpt(document: dict[str, Any], *, where: str) -> ImportedDialog:
    mapping = document.get("mapping")
    if not isinstance(mapping, dict) or not mapping:
        raise InvalidDocument(
            _("%(where)smapping: missing, empty or not an object.") % {"where": where}
        )
    _count_check(len(mapping))
    for key, node in mapping.items():
        if not isinstance(node, dict):
            raise InvalidDocument(
                _("%(where)smapping[%(key)r]: not an object.") % {"where": where, "key": key[:60]}
            )
        parent = node.get("parent")
        if parent is not None and (not isinstance(parent, str) or parent not in mapping):
            raise InvalidDocument(
                _("%(where)smapping[%(key)r]: parent %(parent)r is not in the mapping.")
                % {"where": where, "key": key[:60], "parent": str(parent)[:60]}
            )
    head = document.get("current_node")
    if head is None:
        # No active node named: the newest leaf.
        leaves = [k for k, n in mapping.items() if not n.get("children")]
        head = max(leaves, key=lambda k: _node_time(mapping[k]) or 0.0) if leaves else None
    if not isinstance(head, str) or head not in mapping:
        raise InvalidDocument(_("%(where)scurrent_node is not in the mapping.") % {"where": where})
    parents = {key: node.get("parent") for key, node in mapping.items()}
    _acyclic(parents, where=f"{where}mapping")
    checked = {
        key: _chatgpt_message(node, where=f"{where}mapping[{key[:60]!r}]")
        for key, node in mapping.items()
    }
    # Hidden and tool nodes are left out: a kept message follows its nearest kept ancestor.
    messages, head_index = _tree(
        checked, parents, head, order=lambda key: (_node_time(mapping[key]) or 0.0, key)
    )
    return ImportedDialog(
        title=_title(document.get("title"), where),
        created_at=_time(document.get("create_time"), f"{where}create_time"),
        messages=messages,
        head=head_index,
    )


def _node_time(node: dict[str, Any]) -> float | None:
    message = node.get("message")
    if isinstance(message, dict) and isinstance(message.get("create_time"), int | float):
        return float(message["create_time"])
    return None


def _chatgpt_message(node: dict[str, Any], *, where: str) -> ImportedMessage | None:
    message = node.get("message")
    if message is None:
        return None  # the root
    if not isinstance(message, dict):
        raise InvalidDocument(_("%(where)s: message is not an object.") % {"where": where})
    author = message.get("author")
    role = author.get("role") if isinstance(author, dict) else None
    if not isinstance(role, str):
        raise InvalidDocument(_("%(where)s: author.role is missing.") % {"where": where})
    if role not in CHATGPT_ROLES | {"system", "tool"}:
        raise InvalidDocument(
            _("%(where)s: unknown author role %(role)r.") % {"where": where, "role": role[:20]}
        )
    metadata = message.get("metadata")
    hidden = isinstance(metadata, dict) and metadata.get("is_visually_hidden_from_conversation")
    content = message.get("content")
    if content is None:
        return None
    if not isinstance(content, dict):
        raise InvalidDocument(_("%(where)s: content is not an object.") % {"where": where})
    parts = content.get("parts")
    if parts is None:
        text = content.get("text")
        parts = [text] if isinstance(text, str) else []
    if not isinstance(parts, list):
        raise InvalidDocument(_("%(where)s: content.parts is not a list.") % {"where": where})
    # Images and other non-text parts are left out; their text is kept.
    text = "\n".join(p for p in parts if isinstance(p, str)).strip()
    if role not in CHATGPT_ROLES or hidden or not text:
        return None
    return ImportedMessage(
        role=role,
        content=_text(text, where),
        created_at=_time(message.get("create_time"), where),
        kind=DEFAULT_KIND[role],
    )


def chatgpt_conversations(document: Any) -> Iterator[tuple[str, ImportedDialog]]:
    """A whole ChatGPT `conversations.json`: each conversation checked on its own, with its
    title for the operator's report (`manage.py import_dialogs`)."""
    if not isinstance(document, list):
        raise InvalidDocument(_("A ChatGPT export's conversations.json is a JSON list."))
    for index, conversation in enumerate(document):
        if not isinstance(conversation, dict):
            raise InvalidDocument(_("[%(i)d]: not an object.") % {"i": index})
        yield str(conversation.get("title") or index), _chatgpt(conversation, where=f"[{index}] ")
