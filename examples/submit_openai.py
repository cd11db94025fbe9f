"""Submit an example job with the official openai SDK: upload the files its job.yaml names, then create the job.

    export CISPO_API_URL=http://127.0.0.1:8000 CISPO_API_KEY=...
    python examples/submit_openai.py examples/gsm8k/job.yaml [--dry-run]

Local file names in job.yaml are read next to it. `method` (type cispo) goes in extra_body: the SDK's own
types know OpenAI's methods only. --dry-run prints the service's checks and creates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml
from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", type=Path, help="an example's job.yaml")
    parser.add_argument("--dry-run", action="store_true", help="check the job; create nothing")
    args = parser.parse_args()
    body = yaml.safe_load(args.job.read_text())
    client = OpenAI(base_url=os.environ.get("CISPO_API_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1",
                    api_key=os.environ["CISPO_API_KEY"])
    for field in ("training_file", "validation_file"):
        if body.get(field) and not body[field].startswith("file-"):
            with (args.job.parent / body[field]).open("rb") as f:
                body[field] = client.files.create(file=f, purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(
        model=body["model"], training_file=body["training_file"], validation_file=body.get("validation_file"),
        suffix=body.get("suffix"), seed=body.get("seed"), extra_body={"method": body["method"]},
        extra_query={"dry_run": "true"} if args.dry_run else None,
    )
    print(json.dumps(job.model_dump(), indent=2) if args.dry_run else job.id)


if __name__ == "__main__":
    main()
