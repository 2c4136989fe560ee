"""The migration that gives messages their parents (SPEC H1): an existing dialog becomes one
straight branch, its head its newest message."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

BEFORE = [("sessions_app", "0009_ids_from_blocks_of_randomness")]
AFTER = [("sessions_app", "0010_message_tree")]


def test_existing_dialogs_become_one_straight_branch(django_user_model):
    # covers: H1
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    Session = old.get_model("sessions_app", "Session")
    Message = old.get_model("sessions_app", "Message")
    User = old.get_model("auth", "User")
    owner = User.objects.create(username="tree-owner")
    full = Session.objects.create(
        owner_id=owner.pk, channel="web", chat_id="c", dialog_id="a", title="a", last_seq=6
    )
    empty = Session.objects.create(
        owner_id=owner.pk, channel="web", chat_id="c", dialog_id="b", title="b", last_seq=3
    )
    # A gap where history was cleared, and a turn with a tool call and its result.
    for seq, role in [(3, "user"), (4, "assistant"), (5, "tool"), (6, "assistant")]:
        Message.objects.create(session_id=full.pk, seq=seq, role=role, content=str(seq))

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(AFTER)
    new = executor.loader.project_state(AFTER).apps
    Session = new.get_model("sessions_app", "Session")
    Message = new.get_model("sessions_app", "Message")
    parents = dict(Message.objects.filter(session_id=full.pk).values_list("seq", "parent_seq"))
    assert parents == {3: None, 4: 3, 5: 4, 6: 5}
    assert Session.objects.get(pk=full.pk).head_seq == 6
    assert Session.objects.get(pk=empty.pk).head_seq == 0
    assert not Session.objects.get(pk=full.pk).forked

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
