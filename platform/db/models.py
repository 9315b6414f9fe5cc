"""ORM models. Every schema change here comes with a migration in migrations/versions/.

Public ids are short prefixed strings (`tn_…`, `ad_…`) so they can be shown to users and never reveal
row counts. Timestamps are stored in UTC.
"""
from __future__ import annotations

import secrets
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite hands back naive values otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("store timezone-aware datetimes only")
        return value.astimezone(timezone.utc) if value is not None else None

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Money(TypeDecorator):
    """Exact money as `Decimal`: SQL NUMERIC(30, 12) on PostgreSQL; canonical decimal text on SQLite, whose
    NUMERIC would silently round through a float. Sum it with `loramux.billing.money.sum_money`."""

    impl = Numeric(30, 12)
    cache_ok = True
    SCALE = Decimal("1e-12")

    def load_dialect_impl(self, dialect):
        if dialect.name == "sqlite":
            return dialect.type_descriptor(Text())
        return dialect.type_descriptor(Numeric(30, 12, asdecimal=True))

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if not isinstance(value, Decimal):
            raise TypeError(f"money must be a Decimal, got {type(value).__name__}")
        value = value.quantize(self.SCALE)
        return format(value, "f") if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return Decimal(value).quantize(self.SCALE)


class Base(DeclarativeBase):
    pass


class Tier(Base):
    """A service tier: queue priority, rate limits and timeouts (prices live with billing). 0 = unlimited."""

    __tablename__ = "tiers"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer)  # higher is scheduled first
    requests_per_min: Mapped[int] = mapped_column(Integer, default=0)
    tokens_per_min: Mapped[int] = mapped_column(Integer, default=0)
    max_concurrent: Mapped[int] = mapped_column(Integer, default=0)
    default_timeout_s: Mapped[float] = mapped_column(Float)
    max_timeout_s: Mapped[float] = mapped_column(Float)
    max_fanout: Mapped[int] = mapped_column(Integer, default=8, server_default="8")  # adapters per fan-out
    max_choices: Mapped[int] = mapped_column(Integer, default=8, server_default="8")  # OpenAI's `n`, at most
    # Trained heads / embeddings in its tenants' uploads, in bytes; 0 = only the server's limit.
    max_adapter_head_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("tn"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tier: Mapped[str] = mapped_column(String(32), default="standard")
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | suspended
    # When a requested adapter cannot be loaded: "none" (503), "base", or an adapter reference to serve instead.
    fallback: Mapped[str] = mapped_column(String(200), default="none", server_default="none")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """A tenant's API key. Only its sha256 is stored (keys are 256-bit random, so no salt is needed);
    `prefix` is the short visible part used to tell keys apart in lists and logs."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)


class Adapter(Base):
    """A named adapter of one tenant; its weights are in versions. Deleting is soft (deleted_at)."""

    __tablename__ = "adapters"
    __table_args__ = (
        # Names are unique among a tenant's live adapters; a deleted name can be used again.
        Index("uq_adapters_tenant_live_name", "tenant_id", "name", unique=True,
              postgresql_where=text("deleted_at IS NULL"), sqlite_where=text("deleted_at IS NULL")),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ad"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    visibility: Mapped[str] = mapped_column(String(16), default="private")  # private | public
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)

    tenant: Mapped[Tenant] = relationship()
    versions: Mapped[list[AdapterVersion]] = relationship(back_populates="adapter", order_by="AdapterVersion.version")


class AdapterVersion(Base):
    """One uploaded set of weights. The blob (server-made key from the digest) is immutable."""

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64), index=True)  # sha256 of the stored blob
    storage_key: Mapped[str] = mapped_column(String(200))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    use_rslora: Mapped[bool] = mapped_column(Boolean, default=False)
    target_modules: Mapped[list] = mapped_column(JSON)
    base_model: Mapped[str] = mapped_column(String(200))  # the model this server served at upload
    # base_model_name_or_path as the adapter's config claims it (a hub id, a local path or None).
    claimed_base_model: Mapped[str | None] = mapped_column(String(500), nullable=True, default=None)
    # The base model's family (HF model_type) the weights were validated against; NULL before 0009.
    base_family: Mapped[str | None] = mapped_column(String(32), nullable=True, default=None)
    # What the adapter changes, as validation found it (adapters/formats/summary.py); NULL before 0010.
    summary: Mapped[dict | None] = mapped_column(JSON, nullable=True, default=None)
    # A version made by a merge: {"method", "parameters", "components": [{"adapter_id", "version", "digest",
    # "weight"}]}; NULL for an upload (and before 0013).
    provenance: Mapped[dict | None] = mapped_column(JSON, nullable=True, default=None)
    status: Mapped[str] = mapped_column(String(16), default="ready")  # ready | deleted
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class AdapterBlob(Base):
    """The lifecycle of one stored blob (blobs are shared by digest): the row every change to its fate locks.

    An upload adds itself to `pending` (committed) before it writes the blob and removes itself in the
    transaction that inserts its version; deleting the blob happens only with this row locked, when no ready
    version uses the digest and no upload is pending (a reservation older than the GC grace period counts as
    an abandoned upload). See `loramux.adapters.storage.registry`."""

    __tablename__ = "adapter_blobs"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    storage_key: Mapped[str] = mapped_column(String(200))
    pending: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # uploads between put and insert
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MedusaHeads(Base):
    """Speculative-decoding heads (kind "medusa") for the base model (`adapter_version_id` NULL) or for one
    adapter version. Each row owns its blob (a server-made key from its digest and its id), so deleting one
    never races another upload of the same bytes. An upload inserts its row as `pending` (committed) before
    it writes the blob and makes it `ready` afterwards, retiring the target's previous heads in the same
    transaction (`deleted_at` + `replaced_by`); rows are never removed but for a failed or abandoned upload,
    so the history stays. At most one ready, live row per (kind, target): the two partial unique indexes.
    See `loramux.adapters.storage.medusa_registry`."""

    __tablename__ = "medusa_heads"
    __table_args__ = (
        Index("uq_medusa_heads_active_version", "kind", "adapter_version_id", unique=True,
              postgresql_where=text("deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NOT NULL"),
              sqlite_where=text("deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NOT NULL")),
        Index("uq_medusa_heads_active_base", "kind", "base_model", unique=True,
              postgresql_where=text("deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NULL"),
              sqlite_where=text("deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NULL")),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("md"))
    kind: Mapped[str] = mapped_column(String(16), default="medusa")
    # NULL: heads for the base model itself (used by requests whose adapter version has none of its own).
    adapter_version_id: Mapped[int | None] = mapped_column(ForeignKey("adapter_versions.id"), nullable=True,
                                                           index=True, default=None)
    base_model: Mapped[str] = mapped_column(String(200))  # the model this server served at upload
    digest: Mapped[str] = mapped_column(String(64), index=True)  # sha256 of the stored blob
    storage_key: Mapped[str] = mapped_column(String(200))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    num_heads: Mapped[int] = mapped_column(Integer)
    hidden_size: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict] = mapped_column(JSON)  # medusa_config.json as uploaded
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending (upload under way) | ready
    replaced_by: Mapped[str | None] = mapped_column(String(32), nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)


class AdminKey(Base):
    """An operator's key for /admin. Only its sha256 is stored, like tenant keys; never valid on tenant routes."""

    __tablename__ = "admin_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("adm"))
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)


class RevokedConsoleSession(Base):
    """A console session signed out before its cookie expired: refused by every ingress replica until then."""

    __tablename__ = "console_revoked_sessions"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # the row is purged after this


class Price(Base):
    """USD per 1M tokens from `effective_from` on, for a base model; `adapter_id` and/or `tier` narrow it
    (the most specific price in force when a request ran applies)."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("base_model", "adapter_id", "tier", "effective_from",
                                       name="uq_prices_scope_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    base_model: Mapped[str] = mapped_column(String(200))
    adapter_id: Mapped[str | None] = mapped_column(ForeignKey("adapters.id"), nullable=True, default=None)
    tier: Mapped[str | None] = mapped_column(String(32), nullable=True, default=None)
    input_per_mtok: Mapped[Decimal] = mapped_column(Money)
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(Money)
    output_per_mtok: Mapped[Decimal] = mapped_column(Money)
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class LedgerEntry(Base):
    """One finished request (or one part of it: a fan-out bills each adapter on its own row) and what it
    cost. Written once (idempotent on (request_id, part))."""

    __tablename__ = "ledger"
    __table_args__ = (Index("ix_ledger_tenant_created", "tenant_id", "created_at"),
                      Index("ix_ledger_created", "created_at"),
                      UniqueConstraint("request_id", "part", name="uq_ledger_request_part"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64))
    part: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # fan-out: 0..N-1, else 0
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    adapter_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    adapter_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier: Mapped[str] = mapped_column(String(32))
    outcome: Mapped[str] = mapped_column(String(16))
    fallback: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    queue_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_ms: Mapped[float] = mapped_column(Float)
    price_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: no price was in force
    input_per_mtok: Mapped[Decimal] = mapped_column(Money)
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(Money)
    output_per_mtok: Mapped[Decimal] = mapped_column(Money)
    cost: Mapped[Decimal] = mapped_column(Money)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)  # when the request arrived
    # The client's id of its end user (OpenAI's `user` field), for its own per-user accounting; not checked.
    end_user: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The engine replica that served the request (scale-out on Ray Serve); None in a single process.
    replica: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # A request that combined adapters with weights: [{"adapter_id", "version", "digest", "weight"}, ...].
    composition: Mapped[list | None] = mapped_column(JSON, nullable=True, default=None)
    # Request labels (`X-Loramux-Tags` / `metadata.tags`), for tag budgets and spend reports; None without any.
    tags: Mapped[list | None] = mapped_column(JSON(none_as_null=True), nullable=True, default=None)  # SQL NULL


class Budget(Base):
    """A spend limit in USD over a period, for a tenant or, within a tenant, one of its keys, an end user (the
    `user` request field) or a tag. `hard`: requests that would not fit are refused (402); soft budgets only
    alert. `subject` is "" for the tenant scope, else the key id, end user or tag."""

    __tablename__ = "budgets"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "subject", name="uq_budgets_scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    scope: Mapped[str] = mapped_column(String(8))  # tenant | key | user | tag
    subject: Mapped[str] = mapped_column(String(256), default="")
    limit_usd: Mapped[Decimal] = mapped_column(Money)
    period: Mapped[str] = mapped_column(String(8))  # day | week | month | total (resets at 00:00 UTC)
    hard: Mapped[bool] = mapped_column(Boolean, default=True)
    alert_at: Mapped[list] = mapped_column(JSON)  # fractions of the limit, as decimal strings ("0.5", "0.8", "1")
    # Bumped by each reservation: on PostgreSQL the row lock, on SQLite the write lock, that orders them.
    lock_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class BudgetSpend(Base):
    """What a budget's period has spent: the ledger costs of the requests it reserved for, added in the
    transaction that writes their ledger rows (plus, for the period a budget was set in, what the ledger held
    then)."""

    __tablename__ = "budget_spend"

    budget_id: Mapped[int] = mapped_column(ForeignKey("budgets.id", ondelete="CASCADE"), primary_key=True)
    period_start: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    spent: Mapped[Decimal] = mapped_column(Money)


class BudgetHold(Base):
    """A reservation: a request's worst-case cost for one part (a fan-out has one per adapter; else part 0)
    against one budget, held from admission until the ledger row of that part is written (which deletes it
    and adds the real cost to `budget_spend`), or until the request ends unbilled. `holder` is the ledger log
    that will bill it and `run` that process's run: after a crash the log's next owner replays it, then drops
    the holds of earlier runs (their requests never reached the log)."""

    __tablename__ = "budget_holds"
    __table_args__ = (Index("ix_budget_holds_budget_period", "budget_id", "period_start"),
                      Index("ix_budget_holds_holder", "holder"))

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    budget_id: Mapped[int] = mapped_column(ForeignKey("budgets.id", ondelete="CASCADE"), primary_key=True)
    period_start: Mapped[datetime] = mapped_column(UTCDateTime)
    amount: Mapped[Decimal] = mapped_column(Money)
    holder: Mapped[str] = mapped_column(String(64))
    run: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Webhook(Base):
    """A tenant's alert endpoint: budget threshold crossings are POSTed there, signed with `secret`
    (HMAC-SHA256 over "<timestamp>.<body>")."""

    __tablename__ = "webhooks"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    url: Mapped[str] = mapped_column(String(2000))
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookEvent(Base):
    """The outbox: one event to deliver to a tenant's webhook, written in the transaction that caused it (a
    budget threshold crossed by a ledger row), so none is lost or made twice (`dedupe_key` is unique).
    `state`: pending (until delivered; retried with backoff from `next_attempt_at`), delivered, or failed
    (gave up after the last attempt)."""

    __tablename__ = "webhook_events"
    __table_args__ = (Index("ix_webhook_events_due", "state", "next_attempt_at"),
                      Index("ix_webhook_events_tenant", "tenant_id", "created_at"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("evt"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(40))  # budget.threshold
    dedupe_key: Mapped[str] = mapped_column(String(200), unique=True)
    payload: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_status: Mapped[int | None] = mapped_column(Integer, nullable=True, default=None)
    last_error: Mapped[str | None] = mapped_column(String(500), nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)
