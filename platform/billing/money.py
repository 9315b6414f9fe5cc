"""Exact sums of `Money` columns.

PostgreSQL keeps money as NUMERIC(30, 12), whose SQL `SUM` is exact. SQLite keeps it as decimal text (its
NUMERIC would round through a float), so there the rows are streamed and added up as `Decimal`s.
"""
from __future__ import annotations

import decimal
from decimal import Decimal

from sqlalchemy import Numeric, func, select, type_coerce
from sqlalchemy.orm import Session

from loramux.db.models import Money

# Wide enough for any sum of NUMERIC(30, 12) values (the default context keeps only 28 digits).
MONEY_CONTEXT = decimal.Context(prec=60, rounding=decimal.ROUND_HALF_EVEN)
_STREAM_ROWS = 10_000


def sum_money(session: Session, column, *where) -> Decimal:
    """The exact sum of a Money column over the rows matching `where` (SQLAlchemy clauses, ANDed), as a
    Decimal with 12 decimal places; Decimal("0.000000000000") when no row matches. NULLs are skipped."""
    if session.get_bind().dialect.name == "sqlite":
        total = Decimal(0)
        stmt = select(column).where(*where).execution_options(yield_per=_STREAM_ROWS)
        for value in session.execute(stmt).scalars():
            if value is None:
                continue
            if not isinstance(value, Decimal):
                value = _exact(value)
            total = MONEY_CONTEXT.add(total, value)
    else:
        # Bypass Money's result processing: the sum may have more digits than one NUMERIC(30, 12) value.
        value = session.execute(select(type_coerce(func.sum(column), Numeric(asdecimal=True))).where(*where)).scalar()
        total = Decimal(0) if value is None else _exact(value)
    return total.quantize(Money.SCALE, context=MONEY_CONTEXT)


def _exact(value) -> Decimal:
    if isinstance(value, Decimal):
        return value
    if isinstance(value, (int, str)):
        return Decimal(value)
    raise TypeError(f"sum_money needs an exact money column, got a {type(value).__name__} value")
