"""Reading import documents (SPEC H2): every branch read as a tree, each message after its
parent, the head found; what a dialog stores today is its active path."""

# covers: H2

from __future__ import annotations

import copy

import pytest

from sessions_app import importer
from tests.test_carry_api import CHATGPT


def test_a_chatgpt_conversation_is_read_with_its_branches() -> None:
    dialog = importer.parse_document(copy.deepcopy(CHATGPT))
    # The hidden system node is left out; both answers follow the question.
    assert [(m.role, m.content, m.parent) for m in dialog.messages] == [
        ("user", "Plan a day in Kyoto", None),
        ("assistant", "First draft (the old branch)", 0),
        ("assistant", "Fushimi Inari at dawn, then **tea**.", 0),
    ]
    assert dialog.head == 2
    assert [m.content for m in dialog.active_path()] == [
        "Plan a day in Kyoto",
        "Fushimi Inari at dawn, then **tea**.",
    ]


def test_our_document_with_branches_and_its_head() -> None:
    doc = {
        "format": "chatcore.dialog.v1",
        "head_seq": 2,
        "messages": [
            {"seq": 1, "parent_seq": None, "role": "user", "content": "q"},
            {"seq": 2, "parent_seq": 1, "role": "assistant", "content": "first"},
            {"seq": 3, "parent_seq": 1, "role": "assistant", "content": "second"},
        ],
    }
    dialog = importer.parse_document(doc)
    assert [m.parent for m in dialog.messages] == [None, 0, 0]
    assert [m.content for m in dialog.active_path()] == ["q", "first"]
    del doc["head_seq"]  # the newest message by default
    assert [m.content for m in importer.parse_document(doc).active_path()] == ["q", "second"]


def test_a_cycle_off_the_active_path_is_refused() -> None:
    doc = {
        "format": "chatcore.dialog.v1",
        "head_seq": 1,
        "messages": [
            {"seq": 1, "parent_seq": None, "role": "user", "content": "q"},
            {"seq": 2, "parent_seq": 3, "role": "assistant", "content": "a"},
            {"seq": 3, "parent_seq": 2, "role": "assistant", "content": "b"},
        ],
    }
    with pytest.raises(importer.InvalidDocument, match="cycle"):
        importer.parse_document(doc)


def test_a_current_node_that_is_hidden_ends_at_its_nearest_message() -> None:
    doc = copy.deepcopy(CHATGPT)
    doc["mapping"]["a2"]["children"] = ["h"]
    doc["mapping"]["h"] = {
        "id": "h",
        "parent": "a2",
        "children": [],
        "message": {
            "author": {"role": "tool"},
            "content": {"content_type": "text", "parts": ["browsing..."]},
        },
    }
    doc["current_node"] = "h"
    dialog = importer.parse_document(doc)
    assert [m.content for m in dialog.active_path()][-1] == "Fushimi Inari at dawn, then **tea**."
