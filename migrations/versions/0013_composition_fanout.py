"""Fan-out and weighted composition: several ledger rows per request (fan-out: one per adapter, `part`
0..N-1), the composition a request ran with, and where a merged adapter version came from.

- ledger.part: which part of its request a row bills (0 for a plain request); the ledger is now
  idempotent on (request_id, part) instead of request_id alone.
- ledger.composition: for a request that combined adapters with weights, its components
  ([{"adapter_id", "version", "digest", "weight"}, ...]); NULL otherwise.
- adapter_versions.provenance: for a version made by a merge, its method, parameters and component
  digests; NULL for an upload.
- tiers.max_fanout: the most adapters one fan-out request may name (free 2, standard 8, premium 16;
  operator-made tiers get the column default, 8).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# 0003 made request_id unique without naming the constraint: PostgreSQL named it ledger_request_id_key; on
# SQLite the batch copy of the table needs a naming convention to find (and drop) the unnamed one.
FANOUT_SEEDED = {"free": 2, "standard": 8, "premium": 16}
_CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _drop_request_id_unique(batch, bind) -> None:
    batch.drop_constraint("ledger_request_id_key" if bind.dialect.name == "postgresql" else "uq_ledger_request_id",
                          type_="unique")


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("ledger", naming_convention=_CONVENTION) as batch:
        batch.add_column(sa.Column("part", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("composition", sa.JSON(), nullable=True))
        _drop_request_id_unique(batch, bind)
        batch.create_unique_constraint("uq_ledger_request_part", ["request_id", "part"])
    with op.batch_alter_table("adapter_versions") as batch:
        batch.add_column(sa.Column("provenance", sa.JSON(), nullable=True))
    with op.batch_alter_table("tiers") as batch:
        batch.add_column(sa.Column("max_fanout", sa.Integer, nullable=False, server_default="8"))
    tiers = sa.table("tiers", sa.column("name", sa.String), sa.column("max_fanout", sa.Integer))
    for name, limit in FANOUT_SEEDED.items():
        op.execute(tiers.update().where(tiers.c.name == name).values(max_fanout=limit))


def downgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("tiers") as batch:
        batch.drop_column("max_fanout")
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("provenance")
    op.execute("DELETE FROM ledger WHERE part <> 0")  # a plain request id is unique again
    with op.batch_alter_table("ledger", naming_convention=_CONVENTION) as batch:
        batch.drop_constraint("uq_ledger_request_part", type_="unique")
        batch.create_unique_constraint(
            "ledger_request_id_key" if bind.dialect.name == "postgresql" else "uq_ledger_request_id",
            ["request_id"])
        batch.drop_column("composition")
        batch.drop_column("part")
