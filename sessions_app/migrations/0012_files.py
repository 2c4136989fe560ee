# H3: uploaded files and the dialogs that use them.

import chatcore.common.ids
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0014_audit"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="File",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=chatcore.common.ids.new_uuid,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                ("size", models.BigIntegerField()),
                ("content_type", models.CharField(max_length=100)),
                (
                    "kind",
                    models.CharField(
                        choices=[("image", "image"), ("text", "text"), ("document", "document")],
                        max_length=16,
                    ),
                ),
                ("checksum", models.CharField(max_length=64)),
                ("storage_key", models.CharField(max_length=255)),
                ("thumbnail_key", models.CharField(blank=True, default="", max_length=255)),
                ("width", models.IntegerField(blank=True, null=True)),
                ("height", models.IntegerField(blank=True, null=True)),
                ("text", models.TextField(blank=True, default="")),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "owner",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="chat_files",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
            },
        ),
        migrations.CreateModel(
            name="FileUse",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "file",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="uses",
                        to="sessions_app.file",
                    ),
                ),
                (
                    "session",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="file_uses",
                        to="sessions_app.session",
                    ),
                ),
            ],
        ),
        migrations.AddIndex(
            model_name="file",
            index=models.Index(fields=["owner", "created_at"], name="idx_file_owner"),
        ),
        migrations.AddIndex(
            model_name="file",
            index=models.Index(fields=["created_at"], name="idx_file_created"),
        ),
        migrations.AddConstraint(
            model_name="fileuse",
            constraint=models.UniqueConstraint(fields=("file", "session"), name="uniq_file_use"),
        ),
    ]
