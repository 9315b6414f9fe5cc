"""Alert webhooks: PUT / GET / DELETE /admin/tenants/{tenant_id}/webhook, GET .../webhook/events lists the
tenant's events (newest first) and POST .../webhook/test queues a `webhook.test` event."""
from __future__ import annotations

from fastapi import APIRouter, Query, Response
from pydantic import Field

from loramux.billing.webhooks import MAX_EVENTS_LISTED, STATES
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import webhooks as ops

router = APIRouter()


class WebhookBody(RequestBody):
    url: str = Field(description="the endpoint that budget alerts are POSTed to: http:// or https://, with a host, "
                                 "at most 2000 characters")
    rotate_secret: bool = Field(default=False, description="replace the signing secret (the answer shows the new "
                                                           "one, once)")


@router.put("/tenants/{tenant_id}/webhook")
def put_webhook(tenant_id: str, body: WebhookBody, services: ServicesDep, response: Response) -> dict:
    hook, created = ops.set_webhook(services, tenant_id, body.url, body.rotate_secret)
    response.status_code = 201 if created else 200
    return hook.as_dict()


@router.get("/tenants/{tenant_id}/webhook")
def get_webhook(tenant_id: str, services: ServicesDep) -> dict:
    return ops.get_webhook(services, tenant_id).as_dict()


@router.delete("/tenants/{tenant_id}/webhook", status_code=204)
def delete_webhook(tenant_id: str, services: ServicesDep) -> None:
    ops.delete_webhook(services, tenant_id)


@router.get("/tenants/{tenant_id}/webhook/events")
def list_webhook_events(tenant_id: str, services: ServicesDep,
                        state: str | None = Query(default=None, description=f"only events in {' | '.join(STATES)}"),
                        limit: int = Query(default=50, description=f"at most this many (1 to {MAX_EVENTS_LISTED})"),
                        ) -> dict:
    return {"events": [e.as_dict() for e in ops.list_events(services, tenant_id, state or None, limit)]}


@router.post("/tenants/{tenant_id}/webhook/test", status_code=202)
def send_test_event(tenant_id: str, services: ServicesDep) -> dict:
    return ops.send_test_event(services, tenant_id).as_dict()
