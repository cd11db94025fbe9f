"""job.enqueue_failed_at: a queued job whose broker message could not be sent

The reconciler sends these on its next pass instead of waiting for its
resend of old queued jobs (minutes). Existing rows start with null: nothing
owed.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0008'
down_revision: Union[str, None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.add_column(sa.Column('enqueue_failed_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.drop_column('enqueue_failed_at')
