"""The SQLite database backend of embedded mode (`chatcore.sqlite.base`)."""
