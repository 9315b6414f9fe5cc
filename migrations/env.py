"""Alembic environment: runs on the connection handed in by loramux.db.Database, or on the URL from
Settings when Alembic is run directly."""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from loramux.db.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    # SQLite cannot ALTER most things in place: batch mode rebuilds the table instead.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        from loramux.settings import Settings

        url = Settings().resolved_database_url()
    engine = create_engine(url)
    with engine.begin() as connection:
        _run(connection)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run them against a database")
run_migrations_online()
