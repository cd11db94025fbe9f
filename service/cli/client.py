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
    pass


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


def upload_file(client: Client, path: Path) -> str:
    with path.open("rb") as f:
        uploaded = client.post("/files", files={"file": (path.name, f, "application/jsonl")},
                               data={"purpose": "fine-tune"})
    print(f"uploaded {path} as {uploaded['id']}", file=sys.stderr)
    return uploaded["id"]


def parse_mapping(text: str, what: str) -> dict:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"{what}: not valid YAML or JSON ({e})") from None
    if isinstance(value, str):  # a bare type name, e.g. --reward json_valid
        value = {"type": value}
    if not isinstance(value, dict):
        raise UsageError(f"{what}: expected a mapping of fields, got {type(value).__name__}")
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
