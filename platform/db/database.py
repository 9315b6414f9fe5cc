"""The database handle: engine, sessions, migrations and a reachability check.

PostgreSQL and SQLite are both supported. SQLite gets foreign keys switched on and a busy timeout so
the server's threads can share one file.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import CursorResult, Result, create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _migrations_dir() -> Path:
    try:  # installed wheel: migrations ship as the package loramux.migrations
        import loramux.migrations as pkg

        return Path(pkg.__file__).resolve().parent
    except ImportError:
        return MIGRATIONS_DIR


class Database:
    def __init__(self, url: str, echo: bool = False):
        parsed = make_url(url)
        self.url = url
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        kwargs: dict = {"echo": echo, "pool_pre_ping": True}
        if self.is_sqlite:
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine: Engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed when the block ends, rolled back on an exception."""
        with self._sessions.begin() as session:
            yield session

    def upgrade(self, revision: str = "head") -> None:
        """Apply the Alembic migrations up to `revision`."""
        from alembic import command

        with self.engine.begin() as connection:
            cfg = self.alembic_config()
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, revision)

    def downgrade(self, revision: str = "base") -> None:
        from alembic import command

        with self.engine.begin() as connection:
            cfg = self.alembic_config()
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, revision)

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def alembic_config(self):
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(_migrations_dir()))
        cfg.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        return cfg

    def check(self) -> None:
        """Raise if the database cannot be reached (for /ready)."""
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def rowcount(result: Result) -> int:
    """The rows an UPDATE or DELETE matched. Session.execute is typed as returning a Result; for those
    statements it is a CursorResult, which has the count."""
    assert isinstance(result, CursorResult)
    return result.rowcount


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()
