"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0001'
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('project',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_project')),
    sa.UniqueConstraint('id', name=op.f('uq_project_id')),
    sa.UniqueConstraint('name', name=op.f('uq_project_name'))
    )
    op.create_table('api_key',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('revoked_at', sa.BigInteger(), nullable=True),
    sa.Column('last_used_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_api_key_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_api_key')),
    sa.UniqueConstraint('id', name=op.f('uq_api_key_id')),
    sa.UniqueConstraint('sha256', name=op.f('uq_api_key_sha256'))
    )
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_key_project_id'), ['project_id'], unique=False)

    op.create_table('file',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.Column('storage_key', sa.String(length=512), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_file_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_file')),
    sa.UniqueConstraint('id', name=op.f('uq_file_id'))
    )
    with op.batch_alter_table('file', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_file_project_id'), ['project_id'], unique=False)

    op.create_table('job',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('status', sa.String(length=24), nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('training_file', sa.String(length=40), nullable=False),
    sa.Column('validation_file', sa.String(length=40), nullable=True),
    sa.Column('reward_function_id', sa.String(length=40), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('method', sa.JSON(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('suffix', sa.String(length=64), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('request_sha256', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('started_at', sa.BigInteger(), nullable=True),
    sa.Column('finished_at', sa.BigInteger(), nullable=True),
    sa.Column('total_steps', sa.Integer(), nullable=False),
    sa.Column('steps_done', sa.Integer(), nullable=False),
    sa.Column('trained_tokens', sa.BigInteger(), nullable=False),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('error_param', sa.String(length=64), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('pause_requested', sa.Boolean(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_epoch', sa.Integer(), nullable=False),
    sa.Column('lease_expires_at', sa.Float(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_job_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job')),
    sa.UniqueConstraint('id', name=op.f('uq_job_id')),
    sa.UniqueConstraint('project_id', 'idempotency_key', name=op.f('uq_job_project_id_idempotency_key'))
    )
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_project_id'), ['project_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_job_reward_function_id'), ['reward_function_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_job_status'), ['status'], unique=False)

    op.create_table('reward_function',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_reward_function_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_reward_function')),
    sa.UniqueConstraint('id', name=op.f('uq_reward_function_id'))
    )
    with op.batch_alter_table('reward_function', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_reward_function_project_id'), ['project_id'], unique=False)

    op.create_table('checkpoint',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('storage_prefix', sa.String(length=512), nullable=False),
    sa.Column('files', sa.JSON(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['job.id'], name=op.f('fk_checkpoint_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_checkpoint')),
    sa.UniqueConstraint('id', name=op.f('uq_checkpoint_id')),
    sa.UniqueConstraint('job_id', 'step', name=op.f('uq_checkpoint_job_id_step'))
    )
    with op.batch_alter_table('checkpoint', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoint_job_id'), ['job_id'], unique=False)

    op.create_table('job_event',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('type', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['job.id'], name=op.f('fk_job_event_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_event')),
    sa.UniqueConstraint('id', name=op.f('uq_job_event_id'))
    )
    with op.batch_alter_table('job_event', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_event_job_id'), ['job_id'], unique=False)

    op.create_table('job_metric',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['job.id'], name=op.f('fk_job_metric_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', 'name', name=op.f('pk_job_metric'))
    )


def downgrade() -> None:
    op.drop_table('job_metric')
    with op.batch_alter_table('job_event', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_event_job_id'))

    op.drop_table('job_event')
    with op.batch_alter_table('checkpoint', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoint_job_id'))

    op.drop_table('checkpoint')
    with op.batch_alter_table('reward_function', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reward_function_project_id'))

    op.drop_table('reward_function')
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_status'))
        batch_op.drop_index(batch_op.f('ix_job_reward_function_id'))
        batch_op.drop_index(batch_op.f('ix_job_project_id'))

    op.drop_table('job')
    with op.batch_alter_table('file', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_file_project_id'))

    op.drop_table('file')
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_key_project_id'))

    op.drop_table('api_key')
    op.drop_table('project')
