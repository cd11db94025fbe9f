"""job retry backoff: not_before

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0003'
down_revision: Union[str, None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.add_column(sa.Column('not_before', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.drop_column('not_before')
