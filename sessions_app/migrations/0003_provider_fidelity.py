"""E5: `truncated` and `filtered` message statuses; the `continue` turn mode."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0002_fairness"),
    ]

    operations = [
        migrations.AlterField(
            model_name="message",
            name="status",
            field=models.CharField(
                blank=True,
                choices=[
                    ("", "complete"),
                    ("cancelled", "cancelled"),
                    ("interrupted", "interrupted"),
                    ("truncated", "truncated"),
                    ("filtered", "filtered"),
                ],
                default="",
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="turn",
            name="mode",
            field=models.CharField(
                choices=[("send", "send"), ("retry", "retry"), ("continue", "continue")],
                default="send",
                max_length=8,
            ),
        ),
    ]
