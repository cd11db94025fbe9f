"""job.model_deleted_at: DELETE /v1/models/{id} retires a job's fine-tuned model

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0006'
down_revision: Union[str, None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch_op:
        batch_op.add_column(sa.Column('model_deleted_at', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch_op:
        batch_op.drop_column('model_deleted_at')
