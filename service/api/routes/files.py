"""/v1/files: upload, list, retrieve, download and delete JSONL datasets (OpenAI's shapes)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from service import files as files_service
from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep, StoreDep
from service.errors import InvalidRequest
from service.repositories import files as files_repo
from service.schemas.api import Deleted, FileObject, ListObject
from service.unsupported_fields import unknown_field_message

router = APIRouter(prefix="/v1/files", tags=["files"])
UPLOAD_FIELDS = {"file", "purpose"}


async def _known_form_fields(request: Request, who: PrincipalDep) -> None:
    """Refuse fields we would otherwise ignore (e.g. expires_after, which we do not implement)."""
    # Takes the principal only so that authentication comes first. The form is parsed once and reused.
    form = await request.form()
    unknown = sorted({k.split("[", 1)[0] for k in form.keys()} - UPLOAD_FIELDS)
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: {unknown_field_message(unknown[0])} (this endpoint takes only 'file' "
                             "and 'purpose')", param=unknown[0])


@router.post("", response_model=FileObject, dependencies=[Depends(_known_form_fields)])
def upload_file(session: SessionDep, store: StoreDep, who: PrincipalDep, settings: SettingsDep,
                file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> FileObject:
    row = files_service.create(session, store, who.project_id, filename=file.filename, purpose=purpose,
                               src=file.file, max_line_bytes=settings.max_upload_line_bytes)
    try:
        session.commit()
    except Exception:
        files_service.discard_object(store, row)
        raise
    return presenters.file(row)


@router.get("", response_model=ListObject[FileObject])
def list_files(session: SessionDep, who: PrincipalDep, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
               order: Literal["asc", "desc"] = "desc", purpose: str | None = None,
               sha256: Annotated[str | None, Query(pattern="^[0-9a-f]{64}$")] = None) -> ListObject:
    rows = files_repo.page(session, who.project_id, after=after, limit=limit, purpose=purpose,
                           ascending=order == "asc", sha256=sha256)
    return presenters.page([presenters.file(r) for r in rows.items], rows.has_more)


@router.get("/{file_id}", response_model=FileObject)
def get_file(file_id: str, session: SessionDep, who: PrincipalDep) -> FileObject:
    return presenters.file(files_service.get(session, who.project_id, file_id))


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, store: StoreDep, who: PrincipalDep) -> StreamingResponse:
    row = files_service.get(session, who.project_id, file_id)
    chunks = store.iter_bytes(row.storage_key)  # raises NotFound now, not mid-stream
    # A job's metrics (a CSV, or a TensorBoard event file: TensorBoard reads only names with `tfevents`), or a dataset.
    if row.purpose != files_service.RESULTS_PURPOSE:
        name = f"{row.id}.jsonl"
    else:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", row.filename) if "tfevents" in row.filename else f"{row.id}.csv"
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={
        "content-length": str(row.bytes), "x-sha256": row.sha256,
        "content-disposition": f'attachment; filename="{name}"'})


@router.delete("/{file_id}", response_model=Deleted)
def delete_file(file_id: str, session: SessionDep, store: StoreDep, who: PrincipalDep) -> Deleted:
    row = files_service.delete(session, who.project_id, file_id)
    session.commit()
    # After the commit: a failed commit must not leave a row whose object is gone.
    files_service.discard_object(store, row)
    return Deleted(id=row.id, object="file")
