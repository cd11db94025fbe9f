"""The `cispo` command line.

    cispo train SPEC.yaml [--output DIR] [--no-resume]   a job locally, no service (resources.gpus processes;
                                                        nodes > 1: on the Ray cluster at CISPO_RAY_ADDRESS)
    cispo worker [--concurrency N]                      a Celery worker for service jobs (one job per GPU)
    cispo serve [--model BASE]...                       a serving worker for /v1/chat/completions, /v1/completions
    cispo tinker                                        the Tinker API's worker: training clients on resident bases
    cispo up | api | db upgrade | keys create           see service/cli/main.py

Heavy imports (torch, transformers) happen inside the commands that need
them, so commands that only touch the service stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from service.cli.main import CliError, add_commands, exit_without_teardown


def _format_validation_error(e: ValidationError) -> str:
    lines = [f"invalid job spec ({e.error_count()} error{'s' if e.error_count() > 1 else ''}):"]
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(spec)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def load_spec(path: Path):
    from service.job_spec.spec import JobSpec

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"cannot read {path}: {e}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SystemExit(_format_validation_error(e))


class ProgressCallbacks:
    """A tqdm bar over trainer steps; metrics appended to metrics.jsonl."""

    def __init__(self, total: int, metrics_path: Path, initial: int = 0):
        from tqdm import tqdm

        # Under torchrun the resumed step is known only when reported: the bar then jumps to it.
        self.bar = tqdm(total=total, initial=initial, desc="cispo", unit="step", dynamic_ncols=True)
        self.metrics = metrics_path.open("a")

    def _write(self, kind: str, step: int, metrics: dict) -> None:
        self.metrics.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self.metrics.flush()

    def on_step(self, step, metrics):
        self._write("train", step, metrics)
        self.bar.update(step - self.bar.n)
        shown = {"reward": f"{metrics['reward_mean']:.3f}"} if "reward_mean" in metrics else {}  # not for SFT
        self.bar.set_postfix(**shown, loss=f"{metrics.get('loss', 0.0):.4f}")

    def on_eval(self, step, metrics):
        self._write("eval", step, metrics)
        self.bar.write(f"step {step}: eval " + ", ".join(f"{k[5:]} {metrics[k]:.3f}" for k in
                                                         ("eval_reward_mean", "eval_loss") if k in metrics))

    def on_checkpoint(self, step, path):
        self.bar.write(f"step {step}: checkpoint {path}")

    def on_reward_errors(self, step, errors):
        from worker.rewards.errors import summarize

        top = "; ".join(f"{m} (x{c})" for m, c in summarize(errors, limit=3))
        self.bar.write(f"step {step}: {len(errors)} samples failed to score: {top}")

    def on_preflight(self, metrics):
        from worker.trainer.learning_signal import preflight_message

        self._write("preflight", 0, metrics)
        self.bar.write(preflight_message(metrics))

    def on_no_signal(self, step, steps):
        from worker.trainer.learning_signal import no_signal_message

        self.bar.write(f"warning: {no_signal_message(step, steps)}")

    def on_warning(self, step, message):
        self.bar.write(f"step {step}: warning: {message}")

    def event(self, message):
        self.bar.write(message)

    def should_stop(self):
        return False

    def close(self):
        self.bar.close()
        self.metrics.close()


def cmd_train(args) -> int:
    spec = load_spec(args.spec)
    output = args.output or args.spec.parent / args.spec.stem
    output.mkdir(parents=True, exist_ok=True)
    from service.settings import get_settings
    from worker.torchrun.launch import RankFailed, run_distributed
    from worker.ray_driver.entry import run_on_ray_cluster
    from worker.ray_driver.errors import RayCapacity
    from worker.rewards.engine import ScoringContext
    from worker.rewards.errors import RewardErrorRateExceeded
    from worker.trainer.learning_signal import NoLearningSignal
    from worker.trainer.loop import Trainer

    # Egress allow-list and judge endpoint from the CISPO_* settings; no project secrets locally.
    scoring = ScoringContext.from_settings(get_settings())
    resume = not args.no_resume
    callbacks = None
    try:
        if spec.resources.on_ray:  # the Ray cluster at CISPO_RAY_ADDRESS, driven from here as the service does
            callbacks = ProgressCallbacks(spec.training.steps, output / "metrics.jsonl")
            result = run_on_ray_cluster(spec, output, callbacks, settings=get_settings(), scoring=scoring,
                                        resume=resume)
        elif spec.resources.gpus > 1:  # the service's own launcher: torchrun, one process per GPU (gloo on a CPU)
            callbacks = ProgressCallbacks(spec.training.steps, output / "metrics.jsonl")
            result = run_distributed(spec, output, callbacks, scoring=scoring, resume=resume)
        else:
            trainer = Trainer(spec, output, resume=resume, scoring=scoring,
                              progress=lambda message: print(f"{message} ...", file=sys.stderr, flush=True))
            callbacks = ProgressCallbacks(spec.training.steps, output / "metrics.jsonl", initial=trainer.step)
            result = trainer.run(callbacks)
    except ValueError as e:  # data, reward, checkpoint or resources problems carry their own message
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RewardErrorRateExceeded, NoLearningSignal, RankFailed, RayCapacity) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if callbacks is not None:
            callbacks.close()
    if result.first_eval and result.last_eval and "eval_reward_mean" in result.last_eval:
        print(
            f"eval reward: {result.first_eval['eval_reward_mean']:.3f} before, "
            f"{result.last_eval['eval_reward_mean']:.3f} after {result.steps_done} steps"
        )
    print(f"adapter: {result.last_checkpoint / 'adapter' if result.last_checkpoint else '(none)'}")
    return 0


def cmd_worker(args) -> int:
    from service.settings import get_settings
    from worker.gpus import concurrency_error

    concurrency = args.concurrency or get_settings().worker_concurrency
    if error := concurrency_error(concurrency, args.pool):
        print(f"cispo worker: {error}", file=sys.stderr)
        return 2
    from worker.celery_app import app

    app.conf.worker_concurrency = concurrency  # the pool children read it to pick their GPU
    code = 0
    try:
        app.worker_main(["worker", "--loglevel=INFO", "-Q", "jobs", f"--pool={args.pool}", f"--concurrency={concurrency}"])
    except SystemExit as stopped:  # how Celery's worker returns
        code = stopped.code if isinstance(stopped.code, int) else (0 if stopped.code is None else 1)
    # Every job is handed back by now; with torch loaded (any worker that ran a job in-process) the
    # interpreter's teardown alone takes seconds (6-8 s seen), the bulk of an idle stop.
    exit_without_teardown(code)


def cmd_serve(args) -> int:
    import logging

    from service.settings import get_settings
    from worker.serving.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = serve(get_settings(), args.model or list(get_settings().resolved_serve_models()))
    exit_without_teardown(code)  # torch's interpreter teardown would add seconds to every stop


def cmd_tinker(args) -> int:
    import logging

    from service.settings import get_settings
    from worker.tinker.runner import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_without_teardown(serve(get_settings()))


def _jobs_at_once(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of jobs from 1 to 64")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The whole `cispo` command tree; each subcommand sets `func`."""
    parser = argparse.ArgumentParser(prog="cispo", description="CISPO reinforcement fine-tuning")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run a job locally, without the service")
    p.add_argument("spec", type=Path, help="job spec (YAML)")
    p.add_argument("--output", type=Path, help="run directory (default: next to the spec, named after it: "
                   "SPEC_DIR/<spec name without .yaml>)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the run directory")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("worker", help="run a Celery worker for service jobs")
    p.add_argument("--pool", default="prefork", choices=["prefork", "solo"],
                   help="prefork gives each job a fresh process; solo runs jobs in the worker itself")
    p.add_argument("--concurrency", type=_jobs_at_once, metavar="N",
                   help="jobs run at once (prefork), one per GPU: child i sees only GPU i "
                        "(default CISPO_WORKER_CONCURRENCY, 1)")
    p.set_defaults(func=cmd_worker)
    p = sub.add_parser("serve", help="serve fine-tuned and base models to /v1/chat/completions and /v1/completions")
    p.add_argument("--model", action="append", metavar="BASE",
                   help="a base model to keep resident and serve (repeatable; default CISPO_SERVE_MODELS); none: "
                        "load whichever base a request names, keeping the last one")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("tinker", help="run the Tinker API's requests (/api/v1) on resident base models")
    p.set_defaults(func=cmd_tinker)
    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that left is handled, not at interpreter exit
        return code
    except CliError as e:
        print(f"cispo: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cispo jobs list | head`: the reader left; not an error of ours
        # Python would report the pipe again when it flushes stdout at exit: point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
