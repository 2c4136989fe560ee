# H1: every message gets the message it follows on its branch, the dialog its head. Existing
# dialogs become one straight branch: each message follows the one before it in seq order
# (a turn's tool calls and results stay together, as they were stored in order), and the
# head is the newest message.

from django.db import migrations, models

FILL_PARENTS = (
    'UPDATE "sessions_app_message" SET "parent_seq" = ('
    ' SELECT MAX(p."seq") FROM "sessions_app_message" p'
    ' WHERE p."session_id" = "sessions_app_message"."session_id"'
    ' AND p."seq" < "sessions_app_message"."seq")'
)
FILL_HEADS = (
    'UPDATE "sessions_app_session" SET "head_seq" = COALESCE(('
    ' SELECT MAX(m."seq") FROM "sessions_app_message" m'
    ' WHERE m."session_id" = "sessions_app_session"."id"), 0)'
)


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0017_title_attempts"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="parent_seq",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="parent seq"),
        ),
        migrations.AddField(
            model_name="session",
            name="head_seq",
            field=models.BigIntegerField(default=0, verbose_name="head seq"),
        ),
        migrations.AddField(
            model_name="session",
            name="forked",
            field=models.BooleanField(default=False, verbose_name="forked"),
        ),
        migrations.AddField(
            model_name="session",
            name="forks",
            field=models.JSONField(blank=True, default=dict, verbose_name="forks"),
        ),
        migrations.AlterField(
            model_name="turn",
            name="mode",
            field=models.CharField(
                choices=[
                    ("send", "send"),
                    ("retry", "retry"),
                    ("continue", "continue"),
                    ("edit", "edit"),
                    ("regenerate", "regenerate"),
                ],
                default="send",
                max_length=10,
                verbose_name="mode",
            ),
        ),
        migrations.RunSQL(FILL_PARENTS, reverse_sql=migrations.RunSQL.noop),
        migrations.RunSQL(FILL_HEADS, reverse_sql=migrations.RunSQL.noop),
    ]
