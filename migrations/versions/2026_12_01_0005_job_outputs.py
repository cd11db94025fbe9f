"""job outputs: sample completions, estimated finish, result file, webhooks

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0005'
down_revision: Union[str, None] = '0004'
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

    op.create_table('webhook_endpoint',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('secret', sa.String(length=100), nullable=False),
    sa.Column('events', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_webhook_endpoint_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_endpoint')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_endpoint_id'))
    )
    with op.batch_alter_table('webhook_endpoint', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_endpoint_project_id'), ['project_id'], unique=False)

    op.create_table('webhook_delivery',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('endpoint_id', sa.String(length=40), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.Float(), nullable=False),
    sa.Column('delivered_at', sa.BigInteger(), nullable=True),
    sa.Column('failed_at', sa.BigInteger(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoint.id'], name=op.f('fk_webhook_delivery_endpoint_id_webhook_endpoint'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['job.id'], name=op.f('fk_webhook_delivery_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_delivery')),
    sa.UniqueConstraint('endpoint_id', 'job_id', name=op.f('uq_webhook_delivery_endpoint_id_job_id')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_delivery_id'))
    )
    with op.batch_alter_table('webhook_delivery', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_delivery_endpoint_id'), ['endpoint_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhook_delivery_next_attempt_at'), ['next_attempt_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('webhook_delivery', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_delivery_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_webhook_delivery_endpoint_id'))

    op.drop_table('webhook_delivery')
    with op.batch_alter_table('webhook_endpoint', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_endpoint_project_id'))

    op.drop_table('webhook_endpoint')
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.drop_column('result_file_id')
        batch_op.drop_column('estimated_finish')

    with op.batch_alter_table('job_sample', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_sample_job_id'))

    op.drop_table('job_sample')
