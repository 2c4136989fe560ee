# The primary keys' default is made in Python (`chatcore.common.ids.new_uuid`), never by the
# database: only the migration state changes. SQLite would otherwise copy every table whose
# field is altered, for nothing.

import chatcore.common.ids
from django.db import migrations, models


def _uuid_pk(model_name: str) -> migrations.AlterField:
    return migrations.AlterField(
        model_name=model_name,
        name="id",
        field=models.UUIDField(
            default=chatcore.common.ids.new_uuid,
            editable=False,
            primary_key=True,
            serialize=False,
        ),
    )


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0008_fewer_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[_uuid_pk(name) for name in ("message", "stagedinput", "turn")],
            database_operations=[],
        ),
    ]
