"""`cispo jobs`: a command-line client of the fine-tuning API (create, list, get, watch, events, control, download,
eval: service/cli/evals.py; export: service/cli/export.py).

It talks HTTP only, so it runs wherever the API is reachable and imports
neither torch nor the worker. The API URL and key come from --api-url and
--api-key or, failing those, CISPO_API_URL and CISPO_API_KEY: the client's
own two settings (the service's Settings describe the server, not a client).

Exit codes: 0 done (for watch: the job succeeded); 1 the job ended failed or
cancelled, or a download did not match its sha256; 2 bad usage; 3 the API
refused the request (its message is printed); 4 the API could not be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from service.cli.client import (DEFAULT_API_URL, EXIT_API_ERROR, EXIT_JOB_ENDED_BADLY, EXIT_UNREACHABLE, EXIT_USAGE,
                                TERMINAL, ApiError, Client, UsageError, checkpoint_id, download_verified,
                                parse_mapping, positive, print_json, read_text, upload_new, uploaded_copy)
from service.cli.evals import add_eval_arguments, cmd_eval
from service.cli.export import add_export_command


# -- output --------------------------------------------------------------------------------------


def utc_time(seconds: int | None) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if seconds else "-"


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = min(width, width * done // total) if total else 0
    return "#" * filled + "-" * (width - filled)


def _queue_place(job: dict) -> str:
    """'#2' for the second queued job workers will take; '-' once it is no longer queued."""
    return f"#{job['queue_position']}" if job.get("queue_position") else "-"


def _progress_line(job: dict, reward: float | None) -> str:
    line = (f"{job['id']}  {job['status']:<10} [{_bar(job['steps_done'], job['total_steps'])}] "
            f"{job['steps_done']}/{job['total_steps']} steps")
    if job.get("queue_position"):
        line += f"  {_queue_place(job)} in the queue"
    return line + (f"  reward {reward:.4f}" if reward is not None else "")


def _event_line(event: dict) -> str:
    return f"{utc_time(event['created_at'])}  {event['level']:<5}  {event['message']}"


# -- commands ------------------------------------------------------------------------------------


def build_request(args) -> tuple[dict, dict[str, Path]]:
    """The POST /v1/fine_tuning/jobs body (SPEC, YAML or JSON, with the flags on top) and its local dataset
    files by field, which the caller resolves to file ids (or, for a dry run, sends along)."""
    body = parse_mapping(read_text(args.spec, "SPEC"), f"SPEC {args.spec}") if args.spec else {}
    for field in ("model", "training_file", "validation_file", "suffix", "seed"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    # `is not None`, never truthiness: a flag the user gave (--steps 0) reaches the API, which refuses it by name.
    if args.reward is not None or args.reward_function is not None or args.steps is not None:
        method = body.setdefault("method", {"type": "cispo"})
        if method.get("type") != "cispo":
            raise UsageError("--reward, --reward-function and --steps set a 'cispo' method; the SPEC's method is "
                             f"{method.get('type')!r}")
        cispo = method.setdefault("cispo", {})
        if args.reward is not None:
            cispo["reward"] = parse_mapping(args.reward, "--reward", typed=True)
        if args.reward_function is not None:
            cispo["reward_function"] = args.reward_function
        if args.steps is not None:
            cispo.setdefault("hyperparameters", {}).setdefault("training", {})["steps"] = args.steps
    local = {}
    for field in ("training_file", "validation_file"):
        value = body.get(field)
        if isinstance(value, str) and not value.startswith("file-"):
            path = Path(value).expanduser()
            if not path.is_file():
                raise UsageError(f"{field}: {value} is neither a file id (file-...) nor a readable local file")
            local[field] = path
    missing = [flag for field, flag in (("model", "--model"), ("training_file", "--training-file"),
                                        ("method", "--reward, --reward-function or a SPEC's method"))
               if body.get(field) in (None, "")]
    if missing:
        raise UsageError(f"a job needs {', '.join(missing)} (from a SPEC file or flags)",
                         usage=args.jobs_parser.format_usage())
    return body, local


def _print_dry_run(report: dict) -> None:
    for check in report["checks"]:
        print(f"{check['status']:<8} {check['name']:<15} {check['message']}")
    seconds = report["estimated_seconds"]
    print(f"estimated duration: {f'about {seconds} s' if seconds is not None else 'unknown'}")


def _dry_run(client: Client, body: dict, local: dict[str, Path]) -> dict:
    """The job checked, nothing created: local files with no uploaded copy are sent for this check only."""
    if not local:
        return client.post("/fine_tuning/jobs", json=body, params={"dry_run": "true"})
    with contextlib.ExitStack() as stack:
        files = {field: (path.name, stack.enter_context(path.open("rb")), "application/jsonl")
                 for field, path in local.items()}
        return client.post("/fine_tuning/jobs/dry_run", data={"job": json.dumps(body)}, files=files)


def cmd_create(args, client: Client) -> int:
    if args.dry_run and args.watch:
        raise UsageError("--dry-run creates no job, so there is nothing to --watch")
    body, local = build_request(args)
    for field, path in list(local.items()):
        found = uploaded_copy(client, path)
        if found is not None:
            body[field] = found
            del local[field]
    if args.dry_run:
        report = _dry_run(client, body, local)
        print_json(report) if args.json else _print_dry_run(report)
        return 0
    for field, path in local.items():
        body[field] = upload_new(client, path)
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = client.post("/fine_tuning/jobs", json=body, headers=headers)
    if args.json:
        print_json(job)
    else:
        print(job["id"])
    return _watch(client, job["id"], args.interval) if args.watch else 0


def cmd_list(args, client: Client) -> int:
    params = {"limit": args.limit, **({"after": args.after} if args.after else {})}
    page = client.get("/fine_tuning/jobs", **params)
    if args.json:
        print_json(page)
        return 0
    print(f"{'ID':<32}  {'STATUS':<16}  {'STEPS':>9}  {'QUEUE':>5}  {'CREATED (UTC)':<19}  MODEL")
    for job in page["data"]:
        steps = f"{job['steps_done']}/{job['total_steps']}"
        print(f"{job['id']:<32}  {job['status']:<16}  {steps:>9}  {_queue_place(job):>5}  "
              f"{utc_time(job['created_at']):<19}  {job['model']}")
    if page["has_more"]:
        print(f"(more: --after {page['data'][-1]['id']})", file=sys.stderr)
    return 0


def cmd_get(args, client: Client) -> int:
    print_json(client.get(f"/fine_tuning/jobs/{args.job}"))
    return 0


def _latest_reward(client: Client, job: dict) -> float | None:
    if not job["steps_done"]:
        return None
    points = client.get(f"/fine_tuning/jobs/{job['id']}/metrics", name="reward_mean",
                        step_min=job["steps_done"])["data"]
    return points[-1]["value"] if points else None


def _watch(client: Client, job_id: str, interval: float) -> int:
    """Redraw one progress line (a new line per change when not on a terminal) until the job ends."""
    tty, last = sys.stdout.isatty(), None
    while True:
        job = client.get(f"/fine_tuning/jobs/{job_id}")
        line = _progress_line(job, _latest_reward(client, job))
        if line != last:
            print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", flush=True)
            last = line
        if job["status"] in TERMINAL:
            break
        time.sleep(interval)
    if tty:
        print()
    if job["status"] == "succeeded":
        print(f"fine-tuned model: {job['fine_tuned_model']}")
        return 0
    if job.get("error"):
        print(f"error: {job['error']['code']}: {job['error']['message']}", file=sys.stderr)
    return EXIT_JOB_ENDED_BADLY


def cmd_watch(args, client: Client) -> int:
    return _watch(client, args.job, args.interval)


def cmd_events(args, client: Client) -> int:
    """The latest events, oldest first; with --follow, new ones as they come until the job ends."""
    seen: set[str] = set()
    while True:
        # The status is read before the events: the worker writes a job's last event with its terminal status
        # (and the API serves events no older than the job it last served), so events read after a terminal
        # status include the last ones. Read after them, the job could end in between, its last events unseen.
        ended = args.follow and client.get(f"/fine_tuning/jobs/{args.job}")["status"] in TERMINAL
        page = client.get(f"/fine_tuning/jobs/{args.job}/events", limit=args.limit)
        fresh = [e for e in reversed(page["data"]) if e["id"] not in seen]
        for event in fresh:
            print(json.dumps(event) if args.json else _event_line(event), flush=True)
            seen.add(event["id"])
        if not args.follow or ended:
            return 0
        time.sleep(args.interval)


def cmd_control(args, client: Client) -> int:
    job = client.post(f"/fine_tuning/jobs/{args.job}/{args.action}")
    if args.json:
        print_json(job)
    else:
        print(f"{job['id']}  {job['status']}")
    return 0


def cmd_download(args, client: Client) -> int:
    """A checkpoint's tar (the latest by default: adapter/, trainer state, manifest), checked against the API's
    sha256."""
    ckpt_id = checkpoint_id(client, args.job, args.checkpoint)
    dest = Path(args.output or f"{ckpt_id}-adapter.tar")
    partial = dest.with_name(dest.name + ".part")
    expected, actual, size = download_verified(client, f"/fine_tuning/jobs/{args.job}/checkpoints/{ckpt_id}/content",
                                               partial)
    if expected != actual:
        partial.unlink()
        print(f"error: the download's sha256 {actual} does not match the API's {expected}; "
              "nothing was saved", file=sys.stderr)
        return EXIT_JOB_ENDED_BADLY
    partial.replace(dest)  # only a verified file takes the final name
    print(f"saved {dest} ({size} bytes, sha256 {expected})")
    return 0


# -- wiring --------------------------------------------------------------------------------------


def _run(args) -> int:
    url = args.api_url or os.environ.get("CISPO_API_URL") or DEFAULT_API_URL
    key = args.api_key or os.environ.get("CISPO_API_KEY")
    try:
        if not key:
            raise UsageError("no API key: pass --api-key or set CISPO_API_KEY (create one: cispo keys create)")
        return args.jobs_func(args, Client(url, key))
    except UsageError as e:
        if e.usage:
            print(e.usage, end="", file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_API_ERROR
    except httpx.TransportError as e:
        print(f"error: cannot reach the API at {url} ({e.__class__.__name__}: {e})", file=sys.stderr)
        return EXIT_UNREACHABLE


def client_group(sub: argparse._SubParsersAction, name: str, help_: str):
    """`cispo NAME ...`, a group of HTTP client commands; returns command(name, func, help) that adds one, with
    the options every client command takes (--api-url, --api-key, --json)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-url", help=f"the API's base URL (default: $CISPO_API_URL or {DEFAULT_API_URL})")
    common.add_argument("--api-key", help="a project API key (default: $CISPO_API_KEY)")
    common.add_argument("--json", action="store_true", help="print the API's JSON instead of text")
    group = sub.add_parser(name, help=help_)
    group.set_defaults(func=_run)
    cmds = group.add_subparsers(dest=f"{name}_command", required=True)

    def command(name: str, func, help_: str, **kwargs) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, parents=[common], help=help_, description=help_, **kwargs)
        p.set_defaults(jobs_func=func, jobs_parser=p)
        return p
    return command


def add_jobs_command(sub: argparse._SubParsersAction) -> None:
    client_command = client_group(sub, "jobs", "fine-tuning jobs on a running API (HTTP client)")

    def command(name: str, func, help_: str, *, job: bool = True, **kwargs) -> argparse.ArgumentParser:
        p = client_command(name, func, help_, **kwargs)
        if job:
            p.add_argument("job", help="the job id (ftjob-...)")
        return p

    create = command("create", cmd_create, "create a job from a SPEC file (the request body as YAML or JSON) "
                     "and/or flags; a local training file is uploaded first, unless the project already has "
                     "a file with the same bytes (sha256), which is reused", job=False)
    create.add_argument("spec", nargs="?", help="YAML/JSON file with the POST /v1/fine_tuning/jobs body")
    create.add_argument("--model")
    create.add_argument("--training-file", help="a file id or a local JSONL path to upload")
    create.add_argument("--validation-file", help="a file id or a local JSONL path to upload")
    create.add_argument("--reward", help='an inline reward spec, e.g. \'{"type": "exact_match", "field": "answer"}\'')
    create.add_argument("--reward-function", help="a registered reward function id (rwfn-...)")
    create.add_argument("--steps", type=int, help="training steps")
    create.add_argument("--suffix")
    create.add_argument("--seed", type=int)
    create.add_argument("--idempotency-key", help="retrying with the same key never creates a second job")
    create.add_argument("--dry-run", action="store_true", help="check the job (model, reward fields, prompt "
                        "lengths, engine) and estimate its duration; creates nothing and uploads nothing (local "
                        "files are sent for the check only, and kept nowhere)")
    create.add_argument("--watch", action="store_true", help="then watch it until it ends")
    create.add_argument("--interval", type=positive(float), default=2.0, help="seconds between polls with --watch")

    listing = command("list", cmd_list, "list the project's jobs, newest first (QUEUE: a queued job's place, "
                      "#1 next)", job=False)
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--after", help="a job id: list the jobs older than it")
    command("get", cmd_get, "print a job as JSON")
    command("watch", cmd_watch, "a progress bar (steps, place in the queue, latest reward) until the job ends; "
            "exit 0 if it succeeded").add_argument("--interval", type=positive(float), default=2.0,
                                                   help="seconds between polls")
    events = command("events", cmd_events, "the job's events, oldest first", aliases=["logs"])
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the job ends")
    events.add_argument("--limit", type=int, default=100)
    events.add_argument("--interval", type=positive(float), default=2.0,
                        help="seconds between polls with --follow")
    for action in ("cancel", "pause", "resume"):
        command(action, cmd_control, f"{action} the job").set_defaults(action=action)
    add_eval_arguments(command("eval", cmd_eval, "score the job's fine-tuned model (or --checkpoint, or --base) "
                               "on a file with its reward: the mean with its 95-percent interval, and a per-row "
                               "results file"))
    download = command("download", cmd_download, "download a checkpoint's tar (its adapter/ loads with PEFT; unpacked, a local init_from), verified by sha256")
    download.add_argument("--checkpoint", help="a checkpoint id (default: the latest)")
    download.add_argument("--output", "-o", help="where to save it (default: <checkpoint>-adapter.tar)")

    add_export_command(command)
