"""job.forecast and job.best_checkpoint_id: what a job's evidence says so far

forecast: the sigmoid fit of reward against compute the worker refits as points arrive
(worker/evals/forecast.py, worker/jobs/job_evidence.py); best_checkpoint_id: the kept checkpoint with the best eval.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0012'
down_revision: Union[str, None] = '0011'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.add_column(sa.Column('forecast', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('best_checkpoint_id', sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job') as batch:
        batch.drop_column('best_checkpoint_id')
        batch.drop_column('forecast')
