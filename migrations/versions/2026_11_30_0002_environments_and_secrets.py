"""environments and secrets

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0002'
down_revision: Union[str, None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('environment',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_environment_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_environment')),
    sa.UniqueConstraint('id', name=op.f('uq_environment_id'))
    )
    with op.batch_alter_table('environment', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_environment_project_id'), ['project_id'], unique=False)

    op.create_table('secret',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.id'], name=op.f('fk_secret_project_id_project'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_secret')),
    sa.UniqueConstraint('id', name=op.f('uq_secret_id')),
    sa.UniqueConstraint('project_id', 'name', name=op.f('uq_secret_project_id_name'))
    )
    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_secret_project_id'), ['project_id'], unique=False)

    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('environment_id', sa.String(length=40), nullable=True))
        batch_op.create_index(batch_op.f('ix_job_environment_id'), ['environment_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_environment_id'))
        batch_op.drop_column('environment_id')

    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_secret_project_id'))

    op.drop_table('secret')
    with op.batch_alter_table('environment', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_environment_project_id'))

    op.drop_table('environment')
