"""webhook outbox reads only pending work: job.webhooks_enqueued_at, partial indexes on pending jobs and deliveries

Existing jobs start with webhooks_enqueued_at null: the first pass after the
upgrade looks at each old finished job once (it never sends twice: deliveries
are unique per endpoint and job), marks it, and never reads it again.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0007'
down_revision: Union[str, None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JOB_PENDING = sa.text('webhooks_enqueued_at IS NULL')
DELIVERY_PENDING = sa.text('delivered_at IS NULL AND failed_at IS NULL')


def upgrade() -> None:
    with op.batch_alter_table('job') as batch_op:
        batch_op.add_column(sa.Column('webhooks_enqueued_at', sa.BigInteger(), nullable=True))
    op.create_index('ix_job_webhooks_pending', 'job', ['finished_at'], postgresql_where=JOB_PENDING,
                    sqlite_where=JOB_PENDING)
    op.drop_index('ix_webhook_delivery_next_attempt_at', table_name='webhook_delivery')
    op.create_index('ix_webhook_delivery_pending', 'webhook_delivery', ['next_attempt_at'],
                    postgresql_where=DELIVERY_PENDING, sqlite_where=DELIVERY_PENDING)


def downgrade() -> None:
    op.drop_index('ix_webhook_delivery_pending', table_name='webhook_delivery')
    op.create_index('ix_webhook_delivery_next_attempt_at', 'webhook_delivery', ['next_attempt_at'])
    op.drop_index('ix_job_webhooks_pending', table_name='job')
    with op.batch_alter_table('job') as batch_op:
        batch_op.drop_column('webhooks_enqueued_at')
