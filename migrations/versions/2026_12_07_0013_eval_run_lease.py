"""eval_run.lease_expires_at and eval_run.cancel_requested: a worker's lease on an eval run, and a cancel asked of one

A worker renews lease_expires_at while it runs the eval; the reconciler fails a running eval whose lease passed
(its worker died). Runs already `running` at upgrade were started by workers that renew nothing: they get an
hour from the upgrade, then count as lost.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""
import time
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0013'
down_revision: Union[str, None] = '0012'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

UNLEASED_GRACE_S = 3600


def upgrade() -> None:
    with op.batch_alter_table('eval_run') as batch:
        batch.add_column(sa.Column('lease_expires_at', sa.Float(), nullable=True))
        batch.add_column(sa.Column('cancel_requested', sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table('eval_run') as batch:
        batch.alter_column('cancel_requested', server_default=None)  # the ORM sets it, as for job
    op.execute(sa.text("UPDATE eval_run SET lease_expires_at = :t WHERE status = 'running'")
               .bindparams(t=time.time() + UNLEASED_GRACE_S))


def downgrade() -> None:
    with op.batch_alter_table('eval_run') as batch:
        batch.drop_column('cancel_requested')
        batch.drop_column('lease_expires_at')
