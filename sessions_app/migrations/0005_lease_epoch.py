from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("sessions_app", "0004_channel_accounts")]

    operations = [
        migrations.AddField(
            model_name="session",
            name="lease_epoch",
            field=models.BigIntegerField(default=0),
        ),
    ]
