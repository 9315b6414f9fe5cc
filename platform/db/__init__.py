"""SQL storage shared by the registry, tenant API and ledger: ORM models and the database handle."""
from loramux.db.database import Database
from loramux.db.models import (
    Adapter,
    AdapterVersion,
    AdminKey,
    ApiKey,
    Base,
    Budget,
    BudgetHold,
    BudgetSpend,
    LedgerEntry,
    MedusaHeads,
    Money,
    Price,
    Tenant,
    Tier,
    Webhook,
    WebhookEvent,
)

__all__ = ["AdminKey", "Adapter", "AdapterVersion", "ApiKey", "Base", "Budget", "BudgetHold", "BudgetSpend", "Database",
           "LedgerEntry", "MedusaHeads", "Money", "Price", "Tenant", "Tier", "Webhook", "WebhookEvent"]
