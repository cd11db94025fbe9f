"""Mutation testing (mutmut 3) over the modules where a bug costs most: `make mutate`, never part of `make test`.

Each module runs in a copy of the checkout of its own (.mutants/<name>/, where mutmut writes its mutants/
tree), with a narrow test selection; mutmut runs, per mutant, only the tests of that selection that executed
the mutated function, so a run takes minutes, not hours. Prints killed / total per module (docs/TESTING.md's mutation table);
`--survivors` lists what lived, to read with `cd .mutants/<name> && python -m mutmut show <mutant>`.

    python bench/mutate.py [--survivors] [NAME ...]      # names: the keys of MODULES; none = all
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutants"

# name: (what to mutate, the tests that judge it, files never to mutate)
MODULES: dict[str, tuple[list[str], list[str], list[str]]] = {
    # worker/cispo/, a file at a time: each with its own tests (logprobs' backward mutants are slow ones).
    "cispo-loss": (["worker/cispo/loss.py"], ["tests/worker/cispo/test_loss.py",
                                              "tests/worker/cispo/test_recipe_math.py"], []),
    "cispo-advantages": (["worker/cispo/advantages.py"], ["tests/worker/cispo/test_advantages.py",
                                                          "tests/worker/cispo/test_recipe_math.py"], []),
    "cispo-turn-advantages": (["worker/cispo/turn_advantages.py"], ["tests/worker/cispo/test_turn_advantages.py"], []),
    "cispo-logprobs": (["worker/cispo/logprobs.py"], ["tests/worker/cispo/test_logprobs.py"], []),
    "egress": (["service/egress.py"], ["tests/service/test_egress.py", "tests/service/test_egress_edges.py"], []),
    "access": (["service/api/access.py", "service/auth.py"],
               ["tests/service/api/test_admission.py", "tests/service/test_auth.py", "tests/service/api/test_access.py",
                "tests/service/api/test_errors.py",
                "tests/service/api/test_poll_cache.py",
                "-k", "not postgresql"], []),
    # The packed path (training.pack_tokens) and the off-policy masks are trained in their own test files.
    "update": (["worker/trainer/update.py", "worker/trainer/plan.py"], ["tests/worker/trainer/test_update.py",
                                              "tests/worker/trainer/test_plan.py",
                                              "tests/worker/trainer/test_packing.py",
                                              "tests/worker/trainer/test_recipe_knobs.py"], []),
    "scoring": (["worker/trainer/scoring.py"], ["tests/worker/trainer/test_scoring.py"], []),
    "checkpoint": (["worker/checkpoints/checkpoint.py"], ["tests/worker/checkpoints/test_checkpoint.py", "tests/worker/checkpoints/test_checkpoint_edges.py"],
                   []),
    # SQLite only (no PostgreSQL, no broker, no training run): the fenced writes, the tenant filters and the state
    # machine, through the repositories themselves and through the API routes that use them.
    "repositories": (["service/repositories/jobs.py", "service/repositories/job_outputs.py",
                      "service/repositories/job_history.py", "service/repositories/pagination.py",
                      "service/repositories/job_lease.py", "service/repositories/job_records.py",
                      "service/repositories/job_recovery.py", "service/repositories/inserts.py"],
                     ["tests/service/repositories/test_lease_fence.py",
                      "tests/service/repositories/test_job_history.py",
                      "tests/service/repositories/test_job_states.py", "tests/service/repositories/test_job_reads.py",
                      "tests/service/repositories/test_job_outputs_repository.py",
                      "tests/service/repositories/test_pagination.py",
                      "tests/service/api/test_isolation.py", "tests/service/api/test_jobs_lifecycle.py",
                      "-k", "not postgresql"], []),
    # The rest of service/repositories/, in three groups by the tests that judge them (SQLite only, like the above):
    # the project-scoped resources and keys, the queue and its broker messages and operator reads, and the registries
    # and the job's evidence. Each repository's own tests sit in tests/service/repositories/test_<name>_repository.py.
    "repositories-tenant": (["service/repositories/secrets.py", "service/repositories/projects.py",
                             "service/repositories/fine_tuned_models.py", "service/repositories/files.py",
                             "service/repositories/webhooks.py"],
                            ["tests/service/repositories/test_secrets_repository.py",
                             "tests/service/repositories/test_projects_repository.py",
                             "tests/service/repositories/test_fine_tuned_models_repository.py",
                             "tests/service/repositories/test_files_repository.py",
                             "tests/service/repositories/test_webhooks_repository.py",
                             "tests/service/test_auth.py", "tests/service/repositories/test_pagination.py",
                             "tests/service/api/test_access.py", "tests/service/cli/test_cli_keys.py",
                             "tests/service/api/test_secret_storage.py",
                             "tests/service/api/test_secrets_and_reward_tests.py", "tests/service/api/test_models.py",
                             "tests/service/api/test_files.py", "tests/service/api/test_webhooks.py",
                             "tests/service/api/test_isolation.py",
                             "-k", "not postgresql"], []),
    "repositories-queue": (["service/repositories/job_queue.py", "service/repositories/job_messages.py",
                            "service/repositories/fleet.py", "service/repositories/evals.py"],
                           ["tests/service/repositories/test_job_queue_repository.py",
                            "tests/service/repositories/test_job_messages_repository.py",
                            "tests/service/repositories/test_fleet_repository.py",
                            "tests/service/repositories/test_evals_repository.py",
                            "tests/service/repositories/test_job_states.py", "tests/service/api/test_queue_position.py",
                            "tests/worker/multi/test_fair_share.py", "tests/service/api/test_broker_outage.py",
                            "tests/worker/jobs/test_eval_reconcile.py", "tests/service/api/test_prometheus.py",
                            "-k", "not postgresql"], []),
    "repositories-registry": (["service/repositories/reward_functions.py", "service/repositories/environments.py",
                               "service/repositories/job_evidence.py", "service/repositories/health.py"],
                              ["tests/service/repositories/test_registry_repositories.py",
                               "tests/service/repositories/test_job_evidence_repository.py",
                               "tests/service/api/test_reward_functions.py",
                               "tests/service/api/test_environments.py", "tests/service/api/test_job_evidence.py",
                               "tests/worker/jobs/test_job_evidence_points.py", "tests/service/api/test_models.py",
                               "tests/service/api/test_health.py", "tests/service/api/test_isolation.py",
                               "-k", "not postgresql"], []),
    # launch.py and child_bootstrap.py run under `python -I -S` (no site-packages, so no mutmut trampoline): not
    # mutated. cgroup.py and uids.py: the limits and the uid leases.
    "sandbox": (["service/sandbox/cgroup.py", "service/sandbox/uids.py"],
                ["tests/service/sandbox/test_cgroup.py", "tests/service/sandbox/test_uids.py",
                 "tests/service/sandbox/test_kernel.py"], []),
    # spawn (start, kill, verify) and the probe that gates user code: by the containment and kernel tests. Every
    # mutant of them runs each sandbox test that starts a sandbox (~40 s on 2 loaded cores): the Python reward and
    # environment tests, which start theirs through the same spawn(), would double that.
    "sandbox-spawn": (["service/sandbox/spawn.py", "service/sandbox/probe.py"],
                      ["tests/service/sandbox/test_containment.py", "tests/service/sandbox/test_kernel.py"], []),
    # The JSON-lines channel to a sandboxed child: also by its two users (Python rewards and environments).
    "sandbox-channel": (["service/sandbox/channel.py"],
                        ["tests/service/sandbox/test_containment.py", "tests/service/sandbox/test_kernel.py",
                         "tests/worker/rewards/test_python_reward.py", "tests/worker/envs/test_python_env.py"], []),
}

# mutmut's wall-clock limit per mutant is (the covering tests' time + 1 s) x this. 60 by default: on a loaded
# machine checkpoint's fixture setup (outside the measured time) made mutants that raise at once time out. The
# sandbox's mutants that wait (a kill loop that never sees its namespace empty, an exchange that never times out)
# sleep rather than spin, so they would hold a child for (time + 1) x 60 s each: 15 (mutmut's default) there.
TIMEOUT_MULTIPLIER = {"sandbox-spawn": 15, "sandbox-channel": 15}


def _copy_checkout(dest: Path) -> None:
    """The working tree's files (tracked and new, not ignored) into dest, fresh."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _config(paths: list[str], tests: list[str], skip: list[str], timeout_multiplier: int) -> str:
    quoted = lambda items: "[" + ", ".join(json.dumps(i) for i in items) + "]"  # noqa: E731
    return ("\n[tool.mutmut]\n"
            f"source_paths = {quoted(paths)}\n"
            f"do_not_mutate = {quoted(skip)}\n"
            'also_copy = ["service/", "worker/", "tests/", "migrations/", "bench/", "README.md", "docs/"]\n'
            f"pytest_add_cli_args_test_selection = {quoted(tests)}\n"
            'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
            f"timeout_multiplier = {timeout_multiplier}\n")


def run(name: str, *, survivors: bool) -> dict:
    paths, tests, skip = MODULES[name]
    where = WORK / name
    _copy_checkout(where)
    with open(where / "pyproject.toml", "a") as f:
        f.write(_config(paths, tests, skip, TIMEOUT_MULTIPLIER.get(name, 60)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # import the mutants, not the checkout
    # Every forked mutant run is a new pytest session: without this each would pretrain the toy model again.
    env.setdefault("CISPO_TEST_TOY_DIR", str(WORK / "toy"))
    env["CISPO_TEST_SQLITE_TEMPLATE"] = str(where / ".schema.sqlite")  # migrated once, not per mutant
    env["CISPO_TEST_DATABASES"] = "sqlite"  # every selection on SQLite (tests/conftest.py databases_for)
    # mutmut forks each mutant's run from a process that already ran the tests: torch's OpenMP worker threads do
    # not survive a fork, and the child's first parallel kernel waits for them forever (seen: log_softmax stuck
    # in gomp_team_barrier_wait_end, 0 s of CPU), which mutmut then counts as a timeout, i.e. as killed.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    mutmut = [sys.executable, "-m", "mutmut"]
    subprocess.run([*mutmut, "run", "--max-children", os.environ.get("MUTATE_CHILDREN", "2")], cwd=where,
                   env=env, check=False, stdout=subprocess.DEVNULL)
    subprocess.run([*mutmut, "export-cicd-stats"], cwd=where, env=env, check=True, capture_output=True)
    stats = json.loads((where / "mutants" / "mutmut-cicd-stats.json").read_text())
    if survivors:
        listed = subprocess.run([*mutmut, "results"], cwd=where, env=env, capture_output=True, text=True).stdout
        print(listed)
    return stats


# mutmut's exit codes that count as killed (the tests failed, timed out or crashed on the mutant)
KILLED_CODES = {1, 3, 36, 24, -24, 152, 255, -11, -9}


def per_file(name: str) -> list[tuple[str, int, int]]:
    """(file, killed, mutants) of a finished run, from mutmut's per-file records (the mutation table's per-file breakdown)."""
    mutants = WORK / name / "mutants"
    rows = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"].values()
        rows.append((str(meta.relative_to(mutants))[:-len(".meta")], sum(c in KILLED_CODES for c in codes), len(codes)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--survivors", action="store_true", help="list the mutants that survived or had no test")
    args = parser.parse_args()
    unknown = set(args.names) - set(MODULES)
    if unknown:
        parser.error(f"unknown module(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODULES)}")
    print("| module | mutants | killed | survived | no test | timeout | score |")
    print("|---|---|---|---|---|---|---|")
    for name in args.names or MODULES:
        s = run(name, survivors=args.survivors)
        killed = s["killed"] + s["timeout"] + s["segfault"]
        print(f"| {name} | {s['total']} | {killed} | {s['survived']} | {s['no_tests']} | {s['timeout']} | "
              f"{killed / max(s['total'], 1):.0%} |", flush=True)
        if len(MODULES[name][0]) > 1:
            print("  " + ", ".join(f"{path} {k}/{n} ({k / max(n, 1):.0%})" for path, k, n in per_file(name)),
                  flush=True)


if __name__ == "__main__":
    main()
