"""`cispo files`, `cispo models` and `cispo evals`: the project's files, fine-tuned models and eval runs, over
HTTP like `cispo jobs` (the same --api-url, --api-key, --json and exit codes; service/cli/jobs.py).

`cispo files content ID` prints or saves any file the API holds, checked against its sha256: a dataset, a
job's metrics, or an eval run's per-row results (`cispo evals results RUN` finds that file for the run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.cli.client import (EXIT_JOB_ENDED_BADLY, Client, UsageError, download_verified, parse_mapping,
                                positive, print_json, upload_file, upload_new)
from service.cli.evals import result_line, wait_for
from service.cli.jobs import client_group, utc_time


def _table(rows: list[dict], columns: list[tuple[str, str, int]], page: dict) -> None:
    """Aligned columns (header, key, width; the last one unpadded), then a hint at the next page."""
    print("  ".join(f"{title:<{width}}" for title, _, width in columns).rstrip())
    for row in rows:
        cells = [utc_time(row[key]) if key.endswith(("created_at", "created")) else str(row.get(key) or "-")
                 for _, key, _ in columns]
        print("  ".join(f"{cell:<{width}}" for cell, (_, _, width) in zip(cells, columns)).rstrip())
    if page.get("has_more") and rows:
        print(f"(more: --after {rows[-1]['id']})", file=sys.stderr)


def _listing(client: Client, path: str, args, columns, **params) -> int:
    params = {"limit": args.limit, **({"after": args.after} if args.after else {}),
              **{k: v for k, v in params.items() if v is not None}}
    page = client.get(path, **params)
    print_json(page) if args.json else _table(page["data"], columns, page)
    return 0


def _save_or_print(client: Client, file_id: str, output: str | None) -> int:
    """A file's bytes to `output` (only once they match the API's sha256), or to stdout."""
    url = f"/files/{file_id}/content"
    if output is None:
        with client.http.stream("GET", url) as response:
            if not response.is_success:
                response.read()
                Client.check(response)
            for chunk in response.iter_bytes():
                sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        return 0
    dest = Path(output)
    partial = dest.with_name(dest.name + ".part")
    expected, actual, size = download_verified(client, url, partial)
    if expected != actual:
        partial.unlink()
        print(f"error: the download's sha256 {actual} does not match the API's {expected}; nothing was saved",
              file=sys.stderr)
        return EXIT_JOB_ENDED_BADLY
    partial.replace(dest)
    print(f"saved {dest} ({size} bytes, sha256 {expected})", file=sys.stderr)
    return 0


# -- files ---------------------------------------------------------------------------------------


def cmd_files_list(args, client: Client) -> int:
    return _listing(client, "/files", args, [("ID", "id", 29), ("BYTES", "bytes", 10), ("PURPOSE", "purpose", 17),
                                             ("CREATED (UTC)", "created_at", 19), ("FILENAME", "filename", 0)],
                    purpose=args.purpose)


def cmd_files_upload(args, client: Client) -> int:
    path = Path(args.path).expanduser()
    if not path.is_file():
        raise UsageError(f"{args.path}: no such file")
    print(upload_new(client, path) if args.force else upload_file(client, path))
    return 0


def cmd_files_get(args, client: Client) -> int:
    print_json(client.get(f"/files/{args.file}"))
    return 0


def cmd_files_content(args, client: Client) -> int:
    return _save_or_print(client, args.file, args.output)


def cmd_files_delete(args, client: Client) -> int:
    done = client.check(client.http.delete(f"/files/{args.file}")).json()
    print_json(done) if args.json else print(f"deleted {done['id']}")
    return 0


# -- models --------------------------------------------------------------------------------------


def cmd_models_list(args, client: Client) -> int:
    return _listing(client, "/models", args, [("ID", "id", 60), ("BASE", "root", 24),
                                              ("CREATED (UTC)", "created", 19), ("JOB", "fine_tuning_job_id", 0)])


def cmd_models_get(args, client: Client) -> int:
    print_json(client.get(f"/models/{args.model}"))
    return 0


def cmd_models_delete(args, client: Client) -> int:
    done = client.check(client.http.delete(f"/models/{args.model}")).json()
    print_json(done) if args.json else print(f"deleted {done['id']} (its checkpoints too)")
    return 0


# -- evals ---------------------------------------------------------------------------------------


def cmd_evals_list(args, client: Client) -> int:
    return _listing(client, "/evals", args, [("ID", "id", 30), ("STATUS", "status", 10),
                                             ("CREATED (UTC)", "created_at", 19), ("MODEL", "model", 0)])


def cmd_evals_get(args, client: Client) -> int:
    run = client.get(f"/evals/{args.eval}")
    if args.json:
        print_json(run)
    elif run["status"] == "succeeded":
        print(result_line(run))
    else:
        error = f": {run['error']['message']}" if run.get("error") else ""
        print(f"{run['id']}  {run['status']}{error}")
    return 0


def cmd_evals_create(args, client: Client) -> int:
    if args.reward and args.reward_function:
        raise UsageError("give at most one of --reward and --reward-function")
    path = Path(args.file).expanduser()
    body: dict = {"model": args.model, "file": upload_file(client, path) if path.is_file() else args.file,
                  "max_rows": args.max_rows}
    if args.reward:
        body["reward"] = parse_mapping(args.reward, "--reward", typed=True)
    elif args.reward_function:
        body["reward_function"] = args.reward_function
    return wait_for(client, client.post("/evals", json=body), args)


def cmd_evals_results(args, client: Client) -> int:
    run = client.get(f"/evals/{args.eval}")
    if not run["result_files"]:
        raise UsageError(f"eval run {run['id']} has no results file (status {run['status']})")
    return _save_or_print(client, run["result_files"][0], args.output)


# -- wiring --------------------------------------------------------------------------------------


def _paging(p: argparse.ArgumentParser, limit: int = 20) -> None:
    p.add_argument("--limit", type=int, default=limit)
    p.add_argument("--after", help="an id from the previous page: list the ones after it")


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", help="save it here, once it matches the API's sha256 (default: print it)")


def add_resource_commands(sub: argparse._SubParsersAction) -> None:
    files = client_group(sub, "files", "the project's files: datasets, job metrics, eval results (HTTP client)")
    listing = files("list", cmd_files_list, "list files, newest first")
    _paging(listing, limit=100)
    listing.add_argument("--purpose", help="only files of this purpose: fine-tune (datasets), fine-tune-results "
                         "(a job's metrics), evals (an eval run's results)")
    upload = files("upload", cmd_files_upload, "upload a JSONL dataset and print its id (a file with the same "
                   "bytes already uploaded is reused)")
    upload.add_argument("path")
    upload.add_argument("--force", action="store_true", help="upload even if the same bytes are already there")
    files("get", cmd_files_get, "print a file's metadata as JSON").add_argument("file")
    content = files("content", cmd_files_content, "print or save a file's bytes (a dataset, a job's metrics, an "
                    "eval run's per-row results)", aliases=["download"])
    content.add_argument("file")
    _output(content)
    files("delete", cmd_files_delete, "delete a file (refused while a job that has not finished uses it)"
          ).add_argument("file")

    models = client_group(sub, "models", "the project's fine-tuned models (HTTP client)")
    _paging(models("list", cmd_models_list, "list the fine-tuned models, newest first"))
    models("get", cmd_models_get, "print a model as JSON", aliases=["show"]).add_argument("model")
    models("delete", cmd_models_delete, "delete a fine-tuned model and its checkpoints").add_argument("model")

    evals = client_group(sub, "evals", "eval runs: a model scored on a file with a reward (HTTP client)")
    _paging(evals("list", cmd_evals_list, "list eval runs, newest first"))
    evals("get", cmd_evals_get, "an eval run's status, or its mean reward with the 95%% interval"
          ).add_argument("eval")
    create = evals("create", cmd_evals_create, "score a model (a base, ft:..., or a checkpoint) on a file, wait for "
                   "the result (`cispo jobs eval JOB` takes the job's model and reward)")
    create.add_argument("--model", required=True)
    create.add_argument("--file", required=True, help="a file id or a local JSONL path (uploaded unless the "
                        "same bytes are)")
    create.add_argument("--reward", help="an inline reward spec")
    create.add_argument("--reward-function", help="a registered reward function id (rwfn-...)")
    create.add_argument("--max-rows", type=positive(int), default=1000, help="score the file's first N rows")
    create.add_argument("--interval", type=positive(float), default=2.0, help="seconds between polls")
    results = evals("results", cmd_evals_results, "print or save an eval run's per-row results (JSONL: prompt, "
                    "completion, reward)")
    results.add_argument("eval")
    _output(results)
