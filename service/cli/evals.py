"""`cispo jobs eval JOB --file ROWS`: score a job's fine-tuned model (or a checkpoint, or its base) on a file.

Creates an eval run (POST /v1/evals), shows its progress until a worker has run it, then prints the mean
reward with its 95% interval and the id of the per-row results file (`prompt`, `completion`, `reward`).
The reward is the job's own unless --reward or --reward-function names another.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from service.cli.client import EXIT_JOB_ENDED_BADLY, Client, UsageError, parse_mapping, positive, print_json, upload_file


def _job_reward(job: dict) -> dict:
    """The reward fields of the job's method, for an eval of its base model (which names no job)."""
    method = job.get("method") or {}
    section = method.get(method.get("type"), {}) or {}
    if method.get("type") == "reinforcement":
        return {"grader": section["grader"]}
    picked = {k: section[k] for k in ("reward", "reward_function") if section.get(k) is not None}
    if not picked:
        raise UsageError(f"job {job['id']} has no reward to evaluate with; pass --reward or --reward-function")
    return picked


def build_eval_request(args, client: Client) -> dict:
    job = client.get(f"/fine_tuning/jobs/{args.job}")
    if sum(map(bool, (args.checkpoint, args.base))) > 1:
        raise UsageError("give at most one of --checkpoint and --base")
    if args.base:
        model = job["model"]
    elif args.checkpoint:
        model = args.checkpoint
    elif job.get("fine_tuned_model"):
        model = job["fine_tuned_model"]
    else:
        raise UsageError(f"job {job['id']} has no fine-tuned model yet (status {job['status']}); name one of its "
                         "checkpoints with --checkpoint")
    path = Path(args.file)
    file_id = upload_file(client, path) if path.is_file() else args.file
    body: dict = {"model": model, "file": file_id, "max_rows": args.max_rows}
    if args.reward and args.reward_function:
        raise UsageError("give at most one of --reward and --reward-function")
    if args.reward:
        body["reward"] = parse_mapping(args.reward, "--reward", typed=True)
    elif args.reward_function:
        body["reward_function"] = args.reward_function
    elif args.base:
        body |= _job_reward(job)
    return body


def result_line(run: dict) -> str:
    result, counts = run["result"], run["result_counts"]
    mean, (low, high) = result["mean"], result["interval"]
    # "+/-" only for an interval centred on the mean: a Wilson interval of a pass rate near 0 or 1 is not.
    spread = f" +/- {high - mean:.4f}" if f"{high - mean:.4f}" == f"{mean - low:.4f}" else ""
    files = ", ".join(run["result_files"])
    return (f"{run['model']}: mean reward {mean:.4f}{spread} (95% interval [{low:.4f}, {high:.4f}], "
            f"{result['method']}, n={result['n']}, {counts['errored']} errored); per-row results: {files} "
            f"(cispo files content {run['result_files'][0] if run['result_files'] else 'FILE'})")


def cmd_eval(args, client: Client) -> int:
    return wait_for(client, client.post("/evals", json=build_eval_request(args, client)), args)


def wait_for(client: Client, run: dict, args) -> int:
    """Show an eval run's progress until a worker has run it, then its result (exit 1 if it failed)."""
    started, shown = time.monotonic(), None
    while run["status"] not in ("succeeded", "failed", "cancelled"):
        if run["status"] != shown:
            shown = run["status"]
            print(f"{run['id']}  {shown}", file=sys.stderr)
        else:
            print(f"{run['id']}  {shown}  {time.monotonic() - started:.0f} s", file=sys.stderr)
        time.sleep(args.interval)
        run = client.get(f"/evals/{run['id']}")
    if args.json:
        print_json(run)
    elif run["status"] == "succeeded":
        print(result_line(run))
    if run["status"] == "failed":
        print(f"error: eval run {run['id']} failed: {run['error']['message']}", file=sys.stderr)
        return EXIT_JOB_ENDED_BADLY
    if run["status"] == "cancelled":
        print(f"error: eval run {run['id']} was cancelled", file=sys.stderr)
        return EXIT_JOB_ENDED_BADLY
    return 0


def add_eval_arguments(p) -> None:
    p.add_argument("--file", required=True, help="a file id or a local JSONL path to upload (the rows to score)")
    p.add_argument("--checkpoint", help="a checkpoint (ftckpt_... or its fine_tuned_model_checkpoint) instead of "
                   "the job's fine-tuned model")
    p.add_argument("--base", action="store_true", help="evaluate the job's starting model instead")
    p.add_argument("--reward", help="an inline reward spec (default: the job's reward)")
    p.add_argument("--reward-function", help="a registered reward function id (default: the job's reward)")
    p.add_argument("--max-rows", type=positive(int), default=1000, help="score the file's first N rows")
    p.add_argument("--interval", type=positive(float), default=2.0, help="seconds between polls")
