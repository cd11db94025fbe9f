"""secrets encrypted and bound to hosts; job events indexed by (job_id, seq)

Existing secrets are encrypted with the configured key (CISPO_SECRET_KEY, or
the key file the embedded default creates in CISPO_HOME) and bound to the
hosts their project's reward functions, environments and unfinished jobs
already send them to, so running setups keep working. A secret that nothing
uses is bound to no host: it can be used nowhere until it is recreated with
`hosts`.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from typing import Iterator, Sequence, Union
from urllib.parse import urlsplit

from alembic import op
import sqlalchemy as sa


revision: str = '0004'
down_revision: Union[str, None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

LIVE = ("validating_files", "queued", "running", "paused")


def _uses(spec) -> Iterator[tuple[str, str]]:
    """(secret name, host) for every remote part of a stored spec that names a secret."""
    if isinstance(spec, dict):
        url = spec.get("url") or spec.get("base_url")
        if spec.get("auth_secret") and isinstance(url, str) and urlsplit(url).hostname:
            yield spec["auth_secret"], urlsplit(url).hostname.lower()
        for value in spec.values():
            yield from _uses(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _uses(value)


def _box():
    from service.secrets.box import secret_box
    from service.settings import get_settings

    return secret_box(get_settings())


def upgrade() -> None:
    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ciphertext', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('hosts', sa.JSON(), nullable=True))

    conn = op.get_bind()
    secret = sa.table('secret', sa.column('id', sa.String), sa.column('project_id', sa.String),
                      sa.column('name', sa.String), sa.column('value', sa.Text), sa.column('ciphertext', sa.Text),
                      sa.column('hosts', sa.JSON))
    rows = conn.execute(sa.select(secret.c.id, secret.c.project_id, secret.c.name, secret.c.value)).all()
    if rows:
        box = _box()
        bound: dict[tuple[str, str], set[str]] = {}
        specs = [sa.text("SELECT project_id, spec FROM reward_function"),
                 sa.text("SELECT project_id, spec FROM environment"),
                 sa.text("SELECT project_id, spec FROM job WHERE status IN :live").bindparams(
                     sa.bindparam("live", LIVE, expanding=True))]
        for query in specs:
            for project_id, spec in conn.execute(query.columns(sa.column("project_id", sa.String),
                                                               sa.column("spec", sa.JSON))):
                for name, host in _uses(spec):
                    bound.setdefault((project_id, name), set()).add(host)
        for secret_id, project_id, name, value in rows:
            conn.execute(secret.update().where(secret.c.id == secret_id).values(
                ciphertext=box.seal(value), hosts=sorted(bound.get((project_id, name), ()))))

    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.alter_column('ciphertext', existing_type=sa.Text(), nullable=False)
        batch_op.alter_column('hosts', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column('value')

    with op.batch_alter_table('job_event', schema=None) as batch_op:
        batch_op.create_index('ix_job_event_job_id_seq', ['job_id', 'seq'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('job_event', schema=None) as batch_op:
        batch_op.drop_index('ix_job_event_job_id_seq')

    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.add_column(sa.Column('value', sa.Text(), nullable=True))
    conn = op.get_bind()
    secret = sa.table('secret', sa.column('id', sa.String), sa.column('value', sa.Text),
                      sa.column('ciphertext', sa.Text))
    rows = conn.execute(sa.select(secret.c.id, secret.c.ciphertext)).all()
    if rows:
        box = _box()
        for secret_id, ciphertext in rows:
            conn.execute(secret.update().where(secret.c.id == secret_id).values(value=box.open(ciphertext)))
    with op.batch_alter_table('secret', schema=None) as batch_op:
        batch_op.alter_column('value', existing_type=sa.Text(), nullable=False)
        batch_op.drop_column('hosts')
        batch_op.drop_column('ciphertext')
