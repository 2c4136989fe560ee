"""The audit trail (SPEC H5): who did what to which dialog, token, chat account or user, and
when. `models` holds the append-only record, `trail` the one function that writes it (inside
the transaction of the change it records) and the retention purge, `admin` the read-only
list, `management/commands/audit.py` the JSON-lines export."""
