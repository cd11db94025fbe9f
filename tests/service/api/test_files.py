"""Uploading, listing, reading and deleting dataset files."""

from __future__ import annotations

import hashlib
import io

import pytest
from sqlalchemy import func, select

from service.db.models import File
from tests.service.api.conftest import TRAIN_ROWS, assert_error, cispo_body, jsonl, running_api, upload, uploaded


def _file_rows(api) -> int:
    with api.session() as s:
        return s.scalar(select(func.count()).select_from(File))


def test_upload_stores_object_and_row_with_hash_and_row_count(api):
    content = jsonl(TRAIN_ROWS) + b"\n"  # a trailing blank line is allowed
    r = upload(api.client, content=content)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "file" and body["id"].startswith("file-")
    assert body["bytes"] == len(content) and body["filename"] == "train.jsonl"
    assert (body["purpose"], body["status"], body["expires_at"], body["status_details"]) == \
        ("fine-tune", "processed", None, None)
    assert b"".join(api.store.iter_bytes(f"files/{body['id']}")) == content
    with api.session() as s:
        row = s.scalar(select(File).where(File.id == body["id"]))
        assert row.sha256 == hashlib.sha256(content).hexdigest()
        assert row.rows == len(TRAIN_ROWS)


def test_chat_message_prompts_are_accepted(api):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    assert upload(api.client, rows).status_code == 200


def test_invalid_rows_are_all_reported_with_line_numbers_and_nothing_is_stored(api):
    content = b'{"prompt": "ok"}\nnot json\n{"prompt": ""}\n[1, 2]\n{"answer": "x"}\n' \
              b'{"prompt": [{"role": "user"}]}\n{"prompt": 5}\n'
    error = assert_error(upload(api.client, content=content), 400, "file", "6 invalid row(s)", "line 2",
                         "line 3", "line 4", "line 5", "line 6", "line 7")
    assert error["param"] == "file"
    assert "line 1:" not in error["message"]
    assert _file_rows(api) == 0
    assert api.store.list() == []


def test_error_report_is_capped_at_ten_rows(api):
    r = upload(api.client, content=b"bad\n" * 25)
    error = assert_error(r, 400, "25 invalid row(s)", "line 10:", "(and 15 more)")
    assert "line 11:" not in error["message"]


def test_a_file_of_invalid_rows_is_scanned_in_bounded_memory(tmp_path):
    """200 000 invalid rows: the scan keeps the first ten messages and a count (the old scan kept every message:
    a 4 MB file of such rows took the API from 113 to 362 MB)."""
    import tracemalloc

    from service.files import scan_jsonl

    tracemalloc.start()
    try:
        scan = scan_jsonl(io.BytesIO(b"x\n" * 200_000), tmp_path / "copy.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scan.invalid_rows == 200_000 and len(scan.errors) == 10 and scan.errors[0].startswith("line 1: ")
    assert peak < 2 * 1024 * 1024, peak  # a read chunk and a line; the old scan: 23 MB here


class _Stream(io.RawIOBase):
    """`size` bytes of one line of 'x', then a valid row; counts what was read of it."""

    def __init__(self, size: int):
        self.left, self.read_bytes = size, 0
        self.tail = b'\n{"prompt": "ok"}\n'

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), self.left)
        if n:
            buffer[:n] = b"x" * n
            self.left -= n
        else:
            n = min(len(buffer), len(self.tail))
            buffer[:n], self.tail = self.tail[:n], self.tail[n:]
        self.read_bytes += n
        return n


def test_a_huge_line_is_refused_naming_the_line_without_being_read_whole(tmp_path):
    from service.files import LineTooLong, READ_CHUNK, scan_jsonl

    stream = _Stream(64 * 1024 * 1024)
    with pytest.raises(LineTooLong, match="line 1 is longer than 1048576 bytes"):
        scan_jsonl(io.BufferedReader(stream), tmp_path / "copy.jsonl", max_line_bytes=1024 * 1024)
    assert stream.read_bytes <= 1024 * 1024 + 2 * READ_CHUNK + 8192  # not the 64 MiB line


def test_an_upload_with_a_line_over_the_limit_is_a_400_naming_the_line(database_url, tmp_path):
    content = b'{"prompt": "ok"}\n{"prompt": "ok"}\n{"prompt": "' + b"y" * 5000 + b'"}\n{"prompt": "ok"}\n'
    with running_api(database_url, tmp_path, max_upload_line_bytes=1000) as api:
        error = assert_error(upload(api.client, content=content), 400, "file: line 3 is longer than 1000 bytes")
        assert error["param"] == "file" and error["code"] == "invalid_file"
        assert upload(api.client, content=b'{"prompt": "short"}\n').status_code == 200


def test_empty_and_blank_files_are_refused(api):
    assert_error(upload(api.client, content=b""), 400, "file", "empty")
    assert_error(upload(api.client, content=b"\n  \n"), 400, "file", "no rows")
    assert _file_rows(api) == 0 and api.store.list() == []


def test_purpose_must_be_fine_tune_and_unknown_form_fields_are_refused(api):
    r = api.client.post("/v1/files", files={"file": ("t.jsonl", jsonl(TRAIN_ROWS))}, data={"purpose": "batch"})
    assert assert_error(r, 400, "purpose", "fine-tune")["param"] == "purpose"
    r = api.client.post("/v1/files", files={"file": ("t.jsonl", jsonl(TRAIN_ROWS))},
                        data={"purpose": "fine-tune", "expires_after[seconds]": "3600"})
    assert assert_error(r, 400, "expires_after", "not supported here")["param"] == "expires_after"
    r = api.client.post("/v1/files", data={"purpose": "fine-tune"})
    assert assert_error(r, 400, "file")["param"] == "file"
    assert _file_rows(api) == 0


def test_upload_over_the_size_limit_is_413(database_url, tmp_path):
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from tests.service.api.conftest import _key, make_settings

    app = create_app(make_settings(database_url, tmp_path, max_upload_bytes=2048), enqueue=lambda _: None)
    client = TestClient(app, headers={"Authorization": f"Bearer {_key(database_url, 'p')}"})
    r = client.post("/v1/files", files={"file": ("t.jsonl", jsonl(TRAIN_ROWS * 40))}, data={"purpose": "fine-tune"})
    assert_error(r, 413, "2048")
    assert app.state.store.list() == []


def test_list_paginates_in_both_orders_and_filters_by_purpose(api):
    ids = [uploaded(api.client) for _ in range(5)]
    r = api.client.get("/v1/files", params={"limit": 2})
    page = r.json()
    assert page["object"] == "list" and [f["id"] for f in page["data"]] == ids[::-1][:2]
    assert page["has_more"] is True and (page["first_id"], page["last_id"]) == (ids[4], ids[3])
    seen = [f["id"] for f in page["data"]]
    while page["has_more"]:
        page = api.client.get("/v1/files", params={"limit": 2, "after": page["last_id"]}).json()
        seen += [f["id"] for f in page["data"]]
    assert seen == ids[::-1]
    asc = api.client.get("/v1/files", params={"order": "asc", "limit": 3}).json()
    assert [f["id"] for f in asc["data"]] == ids[:3]
    assert api.client.get("/v1/files", params={"purpose": "batch"}).json()["data"] == []


def test_list_refuses_bad_cursor_limit_and_order(api):
    assert assert_error(api.client.get("/v1/files", params={"after": "file-nope"}), 400, "after")["param"] == "after"
    assert_error(api.client.get("/v1/files", params={"limit": 0}), 400, "limit")
    assert_error(api.client.get("/v1/files", params={"limit": 10001}), 400, "limit")
    assert_error(api.client.get("/v1/files", params={"order": "sideways"}), 400, "order")


def test_get_and_content_return_what_was_uploaded(api):
    content = jsonl(TRAIN_ROWS)
    file_id = upload(api.client, content=content).json()["id"]
    assert api.client.get(f"/v1/files/{file_id}").json()["bytes"] == len(content)
    r = api.client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200 and r.content == content
    assert r.headers["x-sha256"] == hashlib.sha256(content).hexdigest()
    assert_error(api.client.get("/v1/files/file-doesnotexist"), 404, "file-doesnotexist")
    assert_error(api.client.get("/v1/files/file-doesnotexist/content"), 404)


def test_delete_removes_row_and_object(api):
    file_id = uploaded(api.client)
    r = api.client.delete(f"/v1/files/{file_id}")
    assert r.json() == {"id": file_id, "object": "file", "deleted": True}
    assert not api.store.exists(f"files/{file_id}")
    assert_error(api.client.get(f"/v1/files/{file_id}"), 404)
    assert_error(api.client.delete(f"/v1/files/{file_id}"), 404)


def test_delete_is_refused_while_a_live_job_uses_the_file(api):
    file_id = uploaded(api.client)
    job = api.client.post("/v1/fine_tuning/jobs", json=cispo_body(file_id)).json()
    r = api.client.delete(f"/v1/files/{file_id}")
    assert assert_error(r, 409, file_id, job["id"])["code"] == "file_in_use"
    assert r.headers["x-should-retry"] == "false"
    assert api.store.exists(f"files/{file_id}")
    api.client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    assert api.client.delete(f"/v1/files/{file_id}").status_code == 200


def test_openai_rft_message_rows_are_accepted(api):
    rows = [{"messages": [{"role": "developer", "content": "answer in one word"},
                          {"role": "user", "content": "Say alpha"}], "reference_answer": "alpha"},
            {"prompt": "Say beta", "reference_answer": "beta"}]  # both shapes may share a file
    r = upload(api.client, rows)
    assert r.status_code == 200, r.text
    with api.session() as s:
        assert s.scalar(select(File.rows).where(File.id == r.json()["id"])) == 2


def test_bad_message_rows_name_the_line_and_the_field(api):
    content = (b'{"messages": [{"role": "user", "content": "hi"}]}\n'
               b'{"messages": []}\n'
               b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
               b'{"messages": [{"role": "user", "content": 3}]}\n'
               b'{"messages": "hi"}\n'
               b'{"messages": [{"role": "user", "content": "a"}], "prompt": "b"}\n')
    # Line 3 ends with the assistant's turn: a supervised (SFT) row, which an upload may hold; a job checks its
    # rows against its method (tests/e2e/test_supervised_then_cispo.py).
    error = assert_error(upload(api.client, content=content), 400, "4 invalid row(s)",
                         "line 2: 'messages' is an empty list",
                         "line 4: 'messages'[0] needs a string 'content'",
                         "line 5: 'messages' must be a list",
                         "line 6: give 'prompt' or 'messages', not both")
    assert "line 1:" not in error["message"] and "line 3:" not in error["message"]
    assert _file_rows(api) == 0


def test_rows_python_cannot_carry_are_refused_naming_the_line(api):
    """Valid JSON that fails later (a 500 at upload, or three failed training attempts): nesting past the
    parser's stack, a number past Python's digit limit, a lone surrogate a tokenizer cannot encode."""
    deep = b'{"prompt": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    content = (b'{"prompt": "ok"}\n' + deep + b'\n{"prompt": "a", "n": ' + b"7" * 5000 + b'}\n'
               b'{"prompt": "say \\ud800"}\n{"messages": [{"role": "user", "content": "\\udfff"}]}\n'
               b'{"prompt": "a", "x": ' + b"[" * 100 + b"]" * 100 + b'}\n{"prompt": "pair \\ud83d\\ude00 ok"}\n')
    error = assert_error(upload(api.client, content=content), 400, "5 invalid row(s)",
                         "line 2: nests arrays and objects deeper than", "line 3: unreadable JSON number",
                         "line 4: prompt holds a lone UTF-16 surrogate (\\ud800 at character 4)",
                         "line 5: messages[0].content holds a lone UTF-16 surrogate",
                         "line 6: x[0][0]")
    assert "line 1:" not in error["message"] and "line 7:" not in error["message"]
    assert _file_rows(api) == 0
