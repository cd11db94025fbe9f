"""Public shapes of webhook endpoints and their deliveries (service/webhooks.py sends them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from service.schemas.api import Request, Text

EventType = Literal["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]
ALL_EVENTS: list[str] = ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]


class WebhookEndpointCreate(Request):
    url: Text = Field(min_length=1, max_length=2048, description="https URL of a public host (an operator may "
                      "allow-list others with CISPO_EGRESS_ALLOW).")
    events: list[EventType] = Field(default_factory=lambda: list(ALL_EVENTS), min_length=1,
                                    description="The job outcomes to send; all three by default.")


class WebhookEndpointObject(BaseModel):
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    id: str
    url: str
    events: list[str]
    created_at: int
    secret: str | None = Field(None, description="The signing secret (whsec_...), returned once, at creation.")


class WebhookDeliveryObject(BaseModel):
    object: Literal["webhook_delivery"] = "webhook_delivery"
    id: str = Field(description="The event id, sent as webhook-id on every attempt.")
    type: str
    fine_tuning_job_id: str
    created_at: int
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_error: str | None
    next_attempt_at: int | None
    delivered_at: int | None
