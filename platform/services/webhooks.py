"""Alert webhooks as the admin API sees them: set, read and remove a tenant's endpoint, list its events and
queue a test event, with the tenant named by id or name (`loramux.billing.webhooks` keeps the data and delivers).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from loramux.billing import webhooks as hooks
from loramux.billing.webhooks import EventInfo, WebhookInfo

if TYPE_CHECKING:
    from loramux.services.container import Services


def set_webhook(services: Services, tenant_ref: str, url: object, rotate_secret: bool = False,
                ) -> tuple[WebhookInfo, bool]:
    """Create or replace the tenant's endpoint; returns it (with its secret when created or rotated) and whether
    it is new (WebhookError: a bad URL)."""
    return hooks.put_webhook(services.db, services.tenancy.tenant(tenant_ref).id, url, rotate_secret)


def get_webhook(services: Services, tenant_ref: str) -> WebhookInfo:
    return hooks.get_webhook(services.db, services.tenancy.tenant(tenant_ref).id)


def delete_webhook(services: Services, tenant_ref: str) -> int:
    """Remove the endpoint; its pending events are failed (returns how many)."""
    return hooks.delete_webhook(services.db, services.tenancy.tenant(tenant_ref).id)


def list_events(services: Services, tenant_ref: str, state: str | None = None, limit: int = 50) -> list[EventInfo]:
    return hooks.list_events(services.db, services.tenancy.tenant(tenant_ref).id, state, limit)


def send_test_event(services: Services, tenant_ref: str) -> EventInfo:
    """Queue a `webhook.test` event and start a delivery pass at once."""
    event = hooks.queue_test_event(services.db, services.tenancy.tenant(tenant_ref).id)
    if services.webhooks is not None:
        services.webhooks.wake()
    return event
