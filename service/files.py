"""Dataset files: validate an upload completely before anything is stored.

Every row is checked with the worker's rule (service/schemas/dataset.py: a
JSON object with our `prompt` or OpenAI's `messages`; blank lines are
skipped), so a job never fails hours later on line 90 000. Errors carry line
numbers and all of them (up to a few) are reported at once. Only a file that
passes gets a storage object and a row; the caller commits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from service.db.models import File, new_id
from service.errors import Conflict, InvalidRequest, NotFound
from service.repositories import files as files_repo
from service.repositories import jobs as jobs_repo
from service.schemas.dataset import row_problem
from service.storage import ObjectStore

log = logging.getLogger(__name__)

PURPOSE = "fine-tune"
RESULTS_PURPOSE = "fine-tune-results"  # a job's metrics CSV, written by the worker (worker/results.py), never uploaded
MAX_REPORTED_ROWS = 10
MAX_FILENAME = 512


@dataclass
class Scan:
    bytes: int
    sha256: str
    rows: int
    errors: list[str]


def row_error(line: bytes) -> str | None:
    """What is wrong with one JSONL line, or None."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not valid UTF-8"
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at column {e.colno})"
    return row_problem(row)


def scan_jsonl(src: BinaryIO, copy_to: Path) -> Scan:
    """Hash, count and check every row while copying the upload to a named file."""
    digest, size, rows, errors = hashlib.sha256(), 0, 0, []
    with open(copy_to, "wb") as out:
        for line_no, line in enumerate(src, start=1):
            digest.update(line)
            size += len(line)
            out.write(line)
            if not line.strip():
                continue
            if (problem := row_error(line)) is None:
                rows += 1
            else:
                errors.append(f"line {line_no}: {problem}")
    return Scan(bytes=size, sha256=digest.hexdigest(), rows=rows, errors=errors)


def _refuse(scan: Scan) -> None:
    if scan.bytes == 0:
        raise InvalidRequest("file: the file is empty", param="file", code="invalid_file")
    if scan.errors:
        shown = "; ".join(scan.errors[:MAX_REPORTED_ROWS])
        more = f" (and {len(scan.errors) - MAX_REPORTED_ROWS} more)" if len(scan.errors) > MAX_REPORTED_ROWS else ""
        raise InvalidRequest(f"file: {len(scan.errors)} invalid row(s): {shown}{more}", param="file",
                             code="invalid_file")
    if scan.rows == 0:
        raise InvalidRequest("file: the file has no rows (only blank lines)", param="file", code="invalid_file")


@contextmanager
def _scratch() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="cispo-upload-"))
    try:
        yield tmp / "upload.jsonl"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def create(session: Session, store: ObjectStore, project_id: str, *, filename: str | None, purpose: str,
           src: BinaryIO) -> File:
    """Validate, store the object, add the row (uncommitted); nothing is left behind on refusal."""
    if purpose != PURPOSE:
        raise InvalidRequest(f"purpose: must be {PURPOSE!r}, got {purpose!r}", param="purpose")
    if not filename:
        raise InvalidRequest("file: the upload has no filename", param="file")
    if "\x00" in filename:
        raise InvalidRequest("file: the filename contains a NUL character", param="file")
    if len(filename) > MAX_FILENAME:
        raise InvalidRequest(f"file: filename is longer than {MAX_FILENAME} characters", param="file")
    with _scratch() as path:
        scan = scan_jsonl(src, path)
        _refuse(scan)
        file_id = new_id("file-")
        key = f"files/{file_id}"
        file = files_repo.add(session, File(id=file_id, project_id=project_id, filename=filename,
                                            purpose=purpose, bytes=scan.bytes, sha256=scan.sha256,
                                            rows=scan.rows, storage_key=key))
        store.put_file(key, path)
    return file


def iter_rows(store: ObjectStore, file: File) -> Iterator[tuple[int, dict]]:
    """(line number, row) of a stored dataset, streamed; it passed row_problem at upload, blank lines are skipped."""
    pending = b""
    line_no = 0
    for chunk in store.iter_bytes(file.storage_key):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            line_no += 1
            if line.strip():
                yield line_no, json.loads(line)
    if pending.strip():
        yield line_no + 1, json.loads(pending)


def discard_object(store: ObjectStore, file: File) -> None:
    """Undo create()'s upload when the row could not be committed."""
    try:
        store.delete(file.storage_key)
    except Exception:
        log.exception("could not remove orphan object %s", file.storage_key)


def get(session: Session, project_id: str, file_id: str) -> File:
    file = files_repo.get(session, project_id, file_id)
    if file is None:
        raise NotFound(f"no such file: {file_id}", param="file_id")
    return file


def delete(session: Session, project_id: str, file_id: str) -> File:
    """Remove the row (uncommitted); the caller deletes the object after committing."""
    file = get(session, project_id, file_id)
    if job_id := jobs_repo.live_job_uses(session, project_id, file_id=file_id):
        raise Conflict(f"file {file_id} is used by job {job_id}, which has not finished; cancel it or wait",
                       param="file_id", code="file_in_use")
    files_repo.delete(session, file)
    return file
