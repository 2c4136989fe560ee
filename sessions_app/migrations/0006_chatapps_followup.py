import django.utils.timezone
from django.db import migrations, models
from django.db.models import F


def mark_taken_events_done(apps, schema_editor):  # type: ignore[no-untyped-def]
    # Events taken before claims existed were handled then (at most once): they stay done.
    ChannelEvent = apps.get_model("sessions_app", "ChannelEvent")
    ChannelEvent.objects.update(done_at=F("received_at"), claimed_at=F("received_at"))


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0005_lease_epoch"),
    ]

    operations = [
        migrations.AddField(
            model_name="channelevent",
            name="claim",
            field=models.CharField(blank=True, default="", max_length=32),
        ),
        migrations.AddField(
            model_name="channelevent",
            name="claimed_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.AddField(
            model_name="channelevent",
            name="done_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(mark_taken_events_done, migrations.RunPython.noop),
    ]
