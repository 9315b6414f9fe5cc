"""SQL storage shared by the registry, tenant API and ledger: ORM models and the database handle."""
from loramux.db.database import Database
from loramux.db.models import (
    Adapter,
    AdapterVersion,
    AdminKey,
    ApiKey,
    Base,
    LedgerEntry,
    MedusaHeads,
    Money,
    Price,
    Tenant,
    Tier,
)

__all__ = ["AdminKey", "Adapter", "AdapterVersion", "ApiKey", "Base", "Database", "LedgerEntry", "MedusaHeads", "Money",
           "Price", "Tenant", "Tier"]
