"""The `cispo jobs` client's plumbing: HTTP with the API's error envelope, exit codes, and argument parsers
that the job and eval commands share (service/cli/jobs.py, service/cli/evals.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

DEFAULT_API_URL = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "cancelled")
EXIT_JOB_ENDED_BADLY, EXIT_USAGE, EXIT_API_ERROR, EXIT_UNREACHABLE = 1, 2, 3, 4


class UsageError(Exception):
    """Bad usage (exit 2); `usage`, when given, is the command's usage line, printed before the message."""

    def __init__(self, message: str, usage: str | None = None):
        super().__init__(message)
        self.usage = usage


class ApiError(Exception):
    """The API's error envelope, {"error": {message, type, param, code}}, as an exception."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __str__(self) -> str:
        details = ", ".join(f"{k}: {v}" for k, v in (("param", self.param), ("code", self.code)) if v)
        return f"{self.message} (HTTP {self.status}{', ' + details if details else ''})"


class Client:
    def __init__(self, base_url: str, key: str):
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/v1", timeout=60,
                                 headers={"Authorization": f"Bearer {key}"})

    @staticmethod
    def check(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            error = response.json()["error"]
            raise ApiError(response.status_code, error["message"], error.get("param"), error.get("code"))
        except (ValueError, KeyError, TypeError):
            raise ApiError(response.status_code, response.text[:500] or response.reason_phrase) from None

    def get(self, path: str, **params) -> dict:
        return self.check(self.http.get(path, params=params)).json()

    def post(self, path: str, **kwargs) -> dict:
        return self.check(self.http.post(path, **kwargs)).json()


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def uploaded_copy(client: Client, path: Path) -> str | None:
    """The id of a dataset file of the project with the same bytes as `path` (the newest), if there is one."""
    sha = file_sha256(path)
    found = client.get("/files", sha256=sha, purpose="fine-tune", limit=1)["data"]
    # Checked here too: a server that does not know the sha256 filter would list every file.
    if found and found[0].get("sha256") == sha:
        print(f"reusing {found[0]['id']} for {path} (already uploaded: same sha256)", file=sys.stderr)
        return found[0]["id"]
    return None


def upload_new(client: Client, path: Path) -> str:
    with path.open("rb") as f:
        uploaded = client.post("/files", files={"file": (path.name, f, "application/jsonl")},
                               data={"purpose": "fine-tune"})
    print(f"uploaded {path} as {uploaded['id']}", file=sys.stderr)
    return uploaded["id"]


def upload_file(client: Client, path: Path) -> str:
    """A file id for the local dataset `path`: the uploaded copy of the same bytes, else a new upload."""
    return uploaded_copy(client, path) or upload_new(client, path)


def read_text(path: str, what: str) -> str:
    """A local file's text; a path that cannot be read is a usage error naming it (exit 2), not a traceback."""
    try:
        return Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{what}: cannot read {path} ({e.__class__.__name__}: {e})") from None


MAPPING_FORMS = ("a JSON object ('{\"type\": \"exact_match\", \"field\": \"answer\"}'), YAML flow "
                 "('{type: exact_match, field: answer}': a space after each colon), or a bare type name "
                 "(json_valid)")


def parse_mapping(text: str, what: str, *, typed: bool = False) -> dict:
    """A mapping given on the command line as JSON, YAML or (typed: a spec with a `type`) a bare type name."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"{what}: not valid YAML or JSON ({e}); give {MAPPING_FORMS}") from None
    if isinstance(value, str):  # a bare type name, e.g. --reward json_valid
        value = {"type": value}
    if not isinstance(value, dict):
        raise UsageError(f"{what}: expected a mapping of fields, got {type(value).__name__}; give {MAPPING_FORMS}")
    # YAML reads '{type:exact}' as the one key 'type:exact' with no value: never what was meant.
    glued = [k for k, v in value.items() if v is None and isinstance(k, str) and ":" in k]
    if glued:
        raise UsageError(f"{what}: {glued[0]!r} reads as one field name (no space after the colon), and {text!r} "
                         f"is not valid JSON; give {MAPPING_FORMS}")
    if typed and "type" not in value:
        raise UsageError(f"{what}: no 'type' field (the kind of spec, e.g. exact_match); give {MAPPING_FORMS}")
    return value


def positive(kind):
    """An argparse type: a number above zero (client-side flags; the API validates the rest by name)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def checkpoint_id(client: Client, job: str, given: str | None) -> str:
    """`given`, or the job's latest checkpoint."""
    if given is not None:
        return given
    latest = client.get(f"/fine_tuning/jobs/{job}/checkpoints", limit=1)["data"]
    if not latest:
        raise ApiError(404, f"job {job} has no checkpoints yet", "fine_tuning_job_id")
    return latest[0]["id"]


def download_verified(client: Client, url: str, dest: Path) -> tuple[str | None, str, int]:
    """Stream `url` into dest: (the API's x-sha256, the bytes' sha256, the size); the caller keeps or drops it."""
    digest, size = hashlib.sha256(), 0
    with client.http.stream("GET", url) as response:
        if not response.is_success:
            response.read()
            Client.check(response)
        expected = response.headers.get("x-sha256")
        with dest.open("wb") as f:
            for chunk in response.iter_bytes():
                digest.update(chunk)
                size += len(chunk)
                f.write(chunk)
    return expected, digest.hexdigest(), size
