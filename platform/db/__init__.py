"""SQL storage shared by the registry, tenant API and ledger: ORM models and the database handle."""
from loramux.db.database import Database
from loramux.db.models import Adapter, AdapterVersion, ApiKey, Base, Tenant, Tier

__all__ = ["Adapter", "AdapterVersion", "ApiKey", "Base", "Database", "Tenant", "Tier"]
