"""tinker_session, tinker_model, tinker_sampler, tinker_request, tinker_checkpoint: the Tinker API's state

The SDK's sessions, training clients (LoRA models) and sampling sessions; every submitted call as a request row
that is its own future (ordered and deduplicated per model on seq_id, and per sampler); saved weights by their
tinker:// path.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0014'
down_revision: Union[str, None] = '0013'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'tinker_checkpoint',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('path', sa.String(length=1024), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('model_id', sa.String(length=120), nullable=False),
        sa.Column('kind', sa.String(length=24), nullable=False),
        sa.Column('storage_key', sa.String(length=1024), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'],
                                name=op.f('fk_tinker_checkpoint_project_id_project'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_tinker_checkpoint')),
        sa.UniqueConstraint('path', name=op.f('uq_tinker_checkpoint_path')),
    )
    with op.batch_alter_table('tinker_checkpoint') as batch:
        batch.create_index(batch.f('ix_tinker_checkpoint_model_id'), ['model_id'], unique=False)
        batch.create_index(batch.f('ix_tinker_checkpoint_project_id'), ['project_id'], unique=False)

    op.create_table(
        'tinker_request',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('session_id', sa.String(length=40), nullable=True),
        sa.Column('model_id', sa.String(length=120), nullable=True),
        sa.Column('sampler_id', sa.String(length=120), nullable=True),
        sa.Column('seq_id', sa.BigInteger(), nullable=True),
        sa.Column('kind', sa.String(length=40), nullable=False),
        sa.Column('body', sa.LargeBinary(), nullable=False),
        sa.Column('body_type', sa.String(length=16), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('result', sa.LargeBinary(), nullable=True),
        sa.Column('result_type', sa.String(length=16), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('error_category', sa.String(length=16), nullable=True),
        sa.Column('worker_id', sa.String(length=200), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=True),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'],
                                name=op.f('fk_tinker_request_project_id_project'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_tinker_request')),
        sa.UniqueConstraint('id', name=op.f('uq_tinker_request_id')),
        sa.UniqueConstraint('model_id', 'seq_id', name=op.f('uq_tinker_request_model_id_seq_id')),
        sa.UniqueConstraint('sampler_id', 'seq_id', name=op.f('uq_tinker_request_sampler_id_seq_id')),
    )
    with op.batch_alter_table('tinker_request') as batch:
        batch.create_index(batch.f('ix_tinker_request_project_id'), ['project_id'], unique=False)
        batch.create_index(batch.f('ix_tinker_request_state'), ['state'], unique=False)

    op.create_table(
        'tinker_session',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.Column('user_metadata', sa.JSON(), nullable=True),
        sa.Column('sdk_version', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('heartbeat_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'],
                                name=op.f('fk_tinker_session_project_id_project'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_tinker_session')),
        sa.UniqueConstraint('id', name=op.f('uq_tinker_session_id')),
    )
    with op.batch_alter_table('tinker_session') as batch:
        batch.create_index(batch.f('ix_tinker_session_project_id'), ['project_id'], unique=False)

    op.create_table(
        'tinker_model',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('id', sa.String(length=120), nullable=False),
        sa.Column('session_id', sa.String(length=40), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('base_model', sa.String(length=512), nullable=False),
        sa.Column('lora_config', sa.JSON(), nullable=False),
        sa.Column('user_metadata', sa.JSON(), nullable=True),
        sa.Column('worker_id', sa.String(length=200), nullable=True),
        sa.Column('held_at', sa.BigInteger(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('released_at', sa.BigInteger(), nullable=True),
        sa.Column('job_id', sa.String(length=40), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['job.id'],
                                name=op.f('fk_tinker_model_job_id_job'), ondelete='SET NULL'),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'],
                                name=op.f('fk_tinker_model_project_id_project'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['session_id'], ['tinker_session.id'],
                                name=op.f('fk_tinker_model_session_id_tinker_session'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_tinker_model')),
        sa.UniqueConstraint('id', name=op.f('uq_tinker_model_id')),
    )
    with op.batch_alter_table('tinker_model') as batch:
        batch.create_index(batch.f('ix_tinker_model_project_id'), ['project_id'], unique=False)
        batch.create_index(batch.f('ix_tinker_model_session_id'), ['session_id'], unique=False)

    op.create_table(
        'tinker_sampler',
        sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('id', sa.String(length=120), nullable=False),
        sa.Column('session_id', sa.String(length=40), nullable=False),
        sa.Column('project_id', sa.String(length=40), nullable=False),
        sa.Column('base_model', sa.String(length=512), nullable=False),
        sa.Column('model_path', sa.String(length=1024), nullable=True),
        sa.Column('source_model_id', sa.String(length=120), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['project_id'], ['project.id'],
                                name=op.f('fk_tinker_sampler_project_id_project'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['session_id'], ['tinker_session.id'],
                                name=op.f('fk_tinker_sampler_session_id_tinker_session'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('seq', name=op.f('pk_tinker_sampler')),
        sa.UniqueConstraint('id', name=op.f('uq_tinker_sampler_id')),
    )
    with op.batch_alter_table('tinker_sampler') as batch:
        batch.create_index(batch.f('ix_tinker_sampler_project_id'), ['project_id'], unique=False)
        batch.create_index(batch.f('ix_tinker_sampler_session_id'), ['session_id'], unique=False)


def downgrade() -> None:
    for table in ('tinker_checkpoint', 'tinker_request', 'tinker_sampler', 'tinker_model', 'tinker_session'):
        op.drop_table(table)  # its indexes go with it
