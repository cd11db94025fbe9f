"""job outputs: sample completions, estimated finish, result file

Revision ID: 0005
Revises: 0002
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0005'
down_revision: Union[str, None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('job_sample',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('advantage', sa.Float(), nullable=True),
    sa.Column('rewards', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['job.id'], name=op.f('fk_job_sample_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_sample')),
    sa.UniqueConstraint('job_id', 'step', 'slot', name=op.f('uq_job_sample_job_id_step_slot'))
    )
    with op.batch_alter_table('job_sample', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_sample_job_id'), ['job_id'], unique=False)

    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('estimated_finish', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('result_file_id', sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.drop_column('result_file_id')
        batch_op.drop_column('estimated_finish')

    with op.batch_alter_table('job_sample', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_sample_job_id'))

    op.drop_table('job_sample')
