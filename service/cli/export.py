"""`cispo jobs export`: a checkpoint as a directory a model loader takes as it is.

--merge: the adapter merged into the base model (GET .../checkpoints/{id}/merged), a directory that
AutoModelForCausalLM.from_pretrained loads without PEFT; the job must have asked for it (training.export:
merged). Without --merge: the checkpoint's adapter/ (PeftModel.from_pretrained over the base loads it).
The tar is checked against the API's sha256, unpacked with tarfile's "data" filter (no links out, no absolute
paths), every file checked against the manifest's sha256, and only then renamed to the output directory.
HTTP only, like the rest of the CLI: no torch here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from service.cli.client import EXIT_JOB_ENDED_BADLY, Client, UsageError, checkpoint_id, download_verified, file_sha256
from service.storage_layout import MANIFEST


def _fetch(client: Client, url: str, dest: Path) -> str | None:
    """Stream `url` to dest; the API's sha256 when the bytes match it, else None."""
    expected, actual, _ = download_verified(client, url, dest)
    return expected if expected == actual else None


def _verify(root: Path, listed: dict, within: str = "") -> str | None:
    """A problem with the unpacked files the manifest lists (those under `within`), or None."""
    for rel, meta in listed.items():
        if not rel.startswith(within):
            continue
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing from the download"
        if file_sha256(path) != meta["sha256"]:
            return f"{rel} does not match the manifest's sha256"
    return None


def _stamp(root: Path, when: float) -> None:
    """Give every unpacked file and directory the time `when`: the API's tars are reproducible (every mtime 0),
    and files dated 1970 look broken and confuse tools that compare times (make, rsync --update)."""
    for path in (root, *root.rglob("*")):
        os.utime(path, (when, when), follow_symlinks=False)


def cmd_export(args, client: Client) -> int:
    ckpt_id = checkpoint_id(client, args.job, args.checkpoint)
    kind = "merged" if args.merge else "adapter"
    dest = Path(args.output or f"{ckpt_id}-{kind}")
    if dest.exists() and any(dest.iterdir() if dest.is_dir() else [dest]):
        raise UsageError(f"--output {dest} exists and is not empty; name a new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        route = "merged" if args.merge else "content"
        tar_path = work / "download.tar"
        sha = _fetch(client, f"/fine_tuning/jobs/{args.job}/checkpoints/{ckpt_id}/{route}", tar_path)
        if sha is None:
            print("error: the download does not match the API's sha256; nothing was saved", file=sys.stderr)
            return EXIT_JOB_ENDED_BADLY
        unpacked = work / "unpacked"
        with tarfile.open(tar_path) as tar:
            tar.extractall(unpacked, filter="data")
        listed = json.loads((unpacked / MANIFEST).read_text())["files"]
        problem = _verify(unpacked, listed, within="" if args.merge else "adapter/")
        if problem:
            print(f"error: {problem}; nothing was saved", file=sys.stderr)
            return EXIT_JOB_ENDED_BADLY
        result = unpacked if args.merge else unpacked / "adapter"
        _stamp(result, time.time())
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        result.rename(dest)
    except (tarfile.TarError, ValueError, KeyError, OSError) as e:
        print(f"error: the download could not be unpacked ({type(e).__name__}: {e}); nothing was saved",
              file=sys.stderr)
        return EXIT_JOB_ENDED_BADLY
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loads = "AutoModelForCausalLM.from_pretrained" if args.merge else "PeftModel.from_pretrained(base, ...)"
    print(f"saved {dest} (checkpoint {ckpt_id}, sha256 {sha}); {loads} loads it")
    return 0


def add_export_command(command) -> None:
    """Registers `export` through jobs.py's `command(name, func, help)`."""
    export = command("export", cmd_export, "save a checkpoint as a loadable directory: --merge for the adapter "
                     "merged into the base model (from_pretrained alone loads it; the job needs training.export: "
                     "merged), else the PEFT adapter; verified by sha256")
    export.add_argument("--checkpoint", help="a checkpoint id (default: the latest)")
    export.add_argument("--merge", action="store_true", help="the merged full-weight model")
    export.add_argument("--output", "-o", help="a new directory (default: <checkpoint>-merged or -adapter)")
