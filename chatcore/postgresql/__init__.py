"""The PostgreSQL database backend of scaled mode (`chatcore.postgresql.base`)."""
