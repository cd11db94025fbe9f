"""eval_run: a model scored on a file by a worker, with mean, interval and a per-row result file

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0010'
down_revision: Union[str, None] = '0009'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'eval_run',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('status', sa.String(length=24), nullable=False),
        sa.Column('model', sa.String(length=512), nullable=False),
        sa.Column('checkpoint_id', sa.String(length=40), nullable=True),
        sa.Column('file_id', sa.String(length=40), nullable=False),
        sa.Column('reward_function_id', sa.String(length=40), nullable=True),
        sa.Column('spec', sa.JSON(), nullable=False),
        sa.Column('result', sa.JSON(), nullable=True),
        sa.Column('result_file_id', sa.String(length=40), nullable=True),
        sa.Column('error_code', sa.String(length=64), nullable=True),
        sa.Column('error_message', sa.Text(), nullable=True),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('owner', sa.String(length=200), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('started_at', sa.BigInteger(), nullable=True),
        sa.Column('finished_at', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_eval_run_project_id_project'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_eval_run')),
        sa.UniqueConstraint('id', name=op.f('uq_eval_run_id')),
    )
    with op.batch_alter_table('eval_run') as batch:
        batch.create_index(batch.f('ix_eval_run_project_id'), ['project_id'], unique=False)
        batch.create_index(batch.f('ix_eval_run_status'), ['status'], unique=False)


def downgrade() -> None:
    op.drop_table('eval_run')
