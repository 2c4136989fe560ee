# H4: a dialog's model and system prompt; the model a turn asked.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0009_ids_from_blocks_of_randomness"),
    ]

    operations = [
        migrations.AddField(
            model_name="session",
            name="model",
            field=models.CharField(blank=True, default="", max_length=200, verbose_name="model"),
        ),
        migrations.AddField(
            model_name="session",
            name="system_prompt",
            field=models.TextField(blank=True, default="", verbose_name="system prompt"),
        ),
        migrations.AddField(
            model_name="turn",
            name="model",
            field=models.CharField(blank=True, default="", max_length=200, verbose_name="model"),
        ),
    ]
