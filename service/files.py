"""Dataset files: validate an upload completely before anything is stored.

Every row is checked with the worker's rule (service/schemas/dataset.py: a
JSON object with our `prompt` or OpenAI's `messages`, which may end with the
assistant's turn for supervised jobs; blank lines are skipped), so a job
never fails hours later on line 90 000. Errors carry line numbers; the
first few are reported with a count of all. Memory stays bounded whatever
the file: it is read in chunks, only those first errors are kept,
and a line longer than `max_line_bytes` is refused as soon as the scan passes
that length, without being read whole. Only a file that passes gets a storage
object and a row; the caller commits.
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
from service.errors import InUse, InvalidRequest, NotFound
from service.repositories import files as files_repo
from service.repositories import jobs as jobs_repo
from service.schemas.dataset import row_problem
from service.schemas.json_text import MAX_NESTING, json_problem, may_hold_problem
from service.storage import ObjectStore

log = logging.getLogger(__name__)

PURPOSE = "fine-tune"
RESULTS_PURPOSE = "fine-tune-results"  # a job's metrics CSV, written by the worker (worker/jobs/results.py), never uploaded
EVAL_RESULTS_PURPOSE = "evals"  # an eval run's per-row JSONL, written by the worker (worker/jobs/eval_runner.py)
MAX_REPORTED_ROWS = 10
MAX_FILENAME = 512
MAX_LINE_BYTES = 8 * 1024 * 1024  # one row (prompt or messages); a longer line is refused
READ_CHUNK = 1 << 18


@dataclass
class Scan:
    bytes: int
    sha256: str
    rows: int
    errors: list[str]  # the first MAX_REPORTED_ROWS
    invalid_rows: int = 0  # all of them


class LineTooLong(InvalidRequest):
    def __init__(self, line_no: int, limit: int):
        super().__init__(f"file: line {line_no} is longer than {limit} bytes (the limit for one row)", param="file",
                         code="invalid_file")


def _lines(src: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line with its newline) in order, reading chunks; a line past the cap raises LineTooLong."""
    parts: list[bytes] = []  # the pieces of a line that spans chunks
    held = line_no = 0
    while chunk := src.read(READ_CHUNK):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            line_no += 1
            if held + end - start > max_line_bytes:
                raise LineTooLong(line_no, max_line_bytes)
            piece = chunk[start:end + 1]
            yield line_no, b"".join((*parts, piece)) if parts else piece
            parts, held, start = [], 0, end + 1
        if start < len(chunk):
            parts.append(chunk[start:])
            held += len(chunk) - start
            if held > max_line_bytes:
                raise LineTooLong(line_no + 1, max_line_bytes)
    if parts:
        yield line_no + 1, b"".join(parts)


def row_error(line: bytes) -> str | None:
    """What is wrong with one JSONL line, or None. Beyond the JSON grammar, a row must parse within Python's
    limits and hold only what the trainer can carry (service/schemas/json_text.py)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not valid UTF-8"
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return f"nests arrays and objects deeper than {MAX_NESTING} levels"
    except ValueError as e:  # an integer longer than Python converts (sys.get_int_max_str_digits())
        return f"unreadable JSON number ({str(e).split(';')[0]})"
    if may_hold_problem(line) and (found := json_problem(row)):
        where, problem = found
        return f"{where or 'the row'} {problem}"
    return row_problem(row, "upload")


def scan_jsonl(src: BinaryIO, copy_to: Path, *, max_line_bytes: int = MAX_LINE_BYTES) -> Scan:
    """Hash, count and check every row while copying the upload to a named file."""
    scan = Scan(bytes=0, sha256="", rows=0, errors=[])
    digest = hashlib.sha256()
    with open(copy_to, "wb") as out:
        for line_no, line in _lines(src, max_line_bytes):
            digest.update(line)
            scan.bytes += len(line)
            out.write(line)
            if not line.strip():
                continue
            if (problem := row_error(line)) is None:
                scan.rows += 1
                continue
            scan.invalid_rows += 1
            if len(scan.errors) < MAX_REPORTED_ROWS:
                scan.errors.append(f"line {line_no}: {problem}")
    scan.sha256 = digest.hexdigest()
    return scan


def _refuse(scan: Scan) -> None:
    if scan.bytes == 0:
        raise InvalidRequest("file: the file is empty", param="file", code="invalid_file")
    if scan.invalid_rows:
        shown = "; ".join(scan.errors)
        more = f" (and {scan.invalid_rows - len(scan.errors)} more)" if scan.invalid_rows > len(scan.errors) else ""
        raise InvalidRequest(f"file: {scan.invalid_rows} invalid row(s): {shown}{more}", param="file",
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
           src: BinaryIO, max_line_bytes: int = MAX_LINE_BYTES) -> File:
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
        scan = scan_jsonl(src, path, max_line_bytes=max_line_bytes)
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
        raise InUse("file", file_id, job_id, param="file_id")
    files_repo.delete(session, file)
    return file
