"""/v1/webhook_endpoints (ours): where job outcomes are POSTed, signed; and what was delivered."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service import webhooks
from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.db.models import WebhookDelivery, WebhookEndpoint
from service.egress import EgressPolicy
from service.repositories import webhooks as webhooks_repo
from service.schemas.api import Deleted, ListObject
from service.schemas.webhooks import WebhookDeliveryObject, WebhookEndpointCreate, WebhookEndpointObject

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"])


def _endpoint(row: WebhookEndpoint, *, secret: bool = False) -> WebhookEndpointObject:
    return WebhookEndpointObject(id=row.id, url=row.url, events=row.events, created_at=row.created_at,
                                 secret=row.secret if secret else None)


def _delivery(row: WebhookDelivery) -> WebhookDeliveryObject:
    status = "delivered" if row.delivered_at else "failed" if row.failed_at else "pending"
    return WebhookDeliveryObject(id=row.id, type=row.type, fine_tuning_job_id=row.job_id, created_at=row.created_at,
                                 status=status, attempts=row.attempts, last_error=row.last_error,
                                 next_attempt_at=int(row.next_attempt_at) if status == "pending" else None,
                                 delivered_at=row.delivered_at)


@router.post("", response_model=WebhookEndpointObject)
def create_endpoint(body: WebhookEndpointCreate, session: SessionDep, who: PrincipalDep,
                    settings: SettingsDep) -> WebhookEndpointObject:
    """Register an endpoint; the answer holds its signing secret, which is never shown again."""
    row = webhooks.register(session, who.project_id, body.url, list(dict.fromkeys(body.events)),
                            EgressPolicy.from_setting(settings.egress_allow))
    session.commit()
    return _endpoint(row, secret=True)


@router.get("", response_model=ListObject[WebhookEndpointObject])
def list_endpoints(session: SessionDep, who: PrincipalDep, after: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    rows = webhooks_repo.page(session, who.project_id, after=after, limit=limit)
    return presenters.page([_endpoint(r) for r in rows.items], rows.has_more)


@router.get("/{webhook_endpoint_id}", response_model=WebhookEndpointObject)
def get_endpoint(webhook_endpoint_id: str, session: SessionDep, who: PrincipalDep) -> WebhookEndpointObject:
    return _endpoint(webhooks.get(session, who.project_id, webhook_endpoint_id))


@router.get("/{webhook_endpoint_id}/deliveries", response_model=ListObject[WebhookDeliveryObject])
def list_deliveries(webhook_endpoint_id: str, session: SessionDep, who: PrincipalDep, after: str | None = None,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    endpoint = webhooks.get(session, who.project_id, webhook_endpoint_id)
    rows = webhooks_repo.deliveries(session, endpoint.id, after=after, limit=limit)
    return presenters.page([_delivery(r) for r in rows.items], rows.has_more)


@router.delete("/{webhook_endpoint_id}", response_model=Deleted)
def delete_endpoint(webhook_endpoint_id: str, session: SessionDep, who: PrincipalDep) -> Deleted:
    row = webhooks.get(session, who.project_id, webhook_endpoint_id)
    webhooks_repo.delete(session, row)  # its pending deliveries go with it
    session.commit()
    return Deleted(id=row.id, object="webhook_endpoint")
