"""job.outage_since: when the object store became unreachable for the job's runs

While set and younger than the deadline (CISPO_OUTAGE_DEADLINE_S), a run the
outage stopped gives its attempt back. Cleared by a committed checkpoint.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0009'
down_revision: Union[str, None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.add_column(sa.Column('outage_since', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.drop_column('outage_since')
