# SPEC H2: share links, and the search index over messages.
#
# PostgreSQL: two GIN indexes on the searchable messages (user and assistant): full text of
# the `simple` configuration (no stemming and no stop words, so a query in any language
# matches the words as written, and the prefix search of a word being typed works), and
# pg_trgm's trigrams, which find a substring of CJK text (the parser keeps a run of Chinese
# characters as one word). The database keeps both in step with every write, whatever the
# path. SQLite: an FTS5 table with the trigram tokenizer, kept in step by triggers (messages
# are also written in hand-made SQL, `sessions_app.rows`, and removed by cascades); its rows
# map to messages through `sessions_app_search_doc`, whose explicit integer key (unlike the
# message table's implicit rowid) survives a VACUUM.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

import sessions_app.share_models

POSTGRESQL_FORWARD = [
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX IF NOT EXISTS idx_message_fts ON sessions_app_message"
    " USING gin (to_tsvector('simple'::regconfig, content)) WHERE role IN ('user', 'assistant')",
    "CREATE INDEX IF NOT EXISTS idx_message_trgm ON sessions_app_message"
    " USING gin (content gin_trgm_ops) WHERE role IN ('user', 'assistant')",
]
POSTGRESQL_BACKWARD = [
    "DROP INDEX IF EXISTS idx_message_trgm",
    "DROP INDEX IF EXISTS idx_message_fts",
]

SQLITE_FORWARD = [
    "CREATE TABLE sessions_app_search_doc ("
    " id INTEGER PRIMARY KEY,"
    " message_id char(32) NOT NULL UNIQUE,"
    " session_id char(32) NOT NULL)",
    "CREATE VIRTUAL TABLE sessions_app_message_fts USING fts5(content, tokenize = 'trigram')",
    "CREATE TRIGGER sessions_app_message_search_ins AFTER INSERT ON sessions_app_message"
    " WHEN new.role IN ('user', 'assistant') BEGIN"
    " INSERT INTO sessions_app_search_doc (message_id, session_id)"
    " VALUES (new.id, new.session_id);"
    " INSERT INTO sessions_app_message_fts (rowid, content)"
    " VALUES (last_insert_rowid(), new.content);"
    " END",
    "CREATE TRIGGER sessions_app_message_search_del AFTER DELETE ON sessions_app_message"
    " WHEN old.role IN ('user', 'assistant') BEGIN"
    " DELETE FROM sessions_app_message_fts WHERE rowid ="
    " (SELECT id FROM sessions_app_search_doc WHERE message_id = old.id);"
    " DELETE FROM sessions_app_search_doc WHERE message_id = old.id;"
    " END",
    # Stored messages are never rewritten (A3); should a row's text or role change anyway,
    # its index entry follows.
    "CREATE TRIGGER sessions_app_message_search_upd AFTER UPDATE OF content, role"
    " ON sessions_app_message BEGIN"
    " DELETE FROM sessions_app_message_fts WHERE rowid ="
    " (SELECT id FROM sessions_app_search_doc WHERE message_id = old.id);"
    " DELETE FROM sessions_app_search_doc WHERE message_id = old.id;"
    " INSERT INTO sessions_app_search_doc (message_id, session_id)"
    " SELECT new.id, new.session_id WHERE new.role IN ('user', 'assistant');"
    " INSERT INTO sessions_app_message_fts (rowid, content)"
    " SELECT last_insert_rowid(), new.content WHERE new.role IN ('user', 'assistant');"
    " END",
    # Messages stored before this migration.
    "INSERT INTO sessions_app_search_doc (message_id, session_id)"
    " SELECT id, session_id FROM sessions_app_message WHERE role IN ('user', 'assistant') ORDER BY rowid",
    "INSERT INTO sessions_app_message_fts (rowid, content)"
    " SELECT d.id, m.content FROM sessions_app_search_doc d"
    " JOIN sessions_app_message m ON m.id = d.message_id",
]
SQLITE_BACKWARD = [
    "DROP TRIGGER IF EXISTS sessions_app_message_search_upd",
    "DROP TRIGGER IF EXISTS sessions_app_message_search_del",
    "DROP TRIGGER IF EXISTS sessions_app_message_search_ins",
    "DROP TABLE IF EXISTS sessions_app_message_fts",
    "DROP TABLE IF EXISTS sessions_app_search_doc",
]


def _run(statements: dict[str, list[str]]):
    def run(apps, schema_editor):
        for sql in statements.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0012_files"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Share",
            fields=[
                (
                    "id",
                    models.CharField(
                        default=sessions_app.share_models.new_share_id,
                        editable=False,
                        max_length=32,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("title", models.CharField(max_length=200)),
                ("messages", models.JSONField(default=list)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "owner",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="shares",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "session",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="shares",
                        to="sessions_app.session",
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
                "indexes": [models.Index(fields=["owner", "created_at"], name="idx_share_owner")],
            },
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRESQL_FORWARD, "sqlite": SQLITE_FORWARD}),
            _run({"postgresql": POSTGRESQL_BACKWARD, "sqlite": SQLITE_BACKWARD}),
        ),
    ]
