"""job.tensorboard_file_id: the TensorBoard event file among a job's result files

Written with the metrics CSV when a job ends (worker/jobs/results.py); listed after it in `result_files`.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0011'
down_revision: Union[str, None] = '0010'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.add_column(sa.Column('tensorboard_file_id', sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.drop_column('tensorboard_file_id')
