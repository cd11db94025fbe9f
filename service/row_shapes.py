"""At job creation: every row of the job's files must suit its method (400 naming the file, line and field).

An upload may hold prompts (CISPO, RFT) or whole conversations (SFT), since its use is not known yet
(service/schemas/dataset.py). A job then checks its files with the trainer's own rule for its method: a
supervised job needs an assistant message in every row, a CISPO job a conversation the model answers.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.dry_run import dataset_rows
from service.errors import InvalidRequest
from service.schemas.dataset import row_problem
from service.job_spec.spec import JobSpec
from service.storage import ObjectStore

MAX_REPORTED = 10


def check_rows_fit_method(session: Session, store: ObjectStore, project_id: str, spec: JobSpec) -> None:
    problems: list[tuple[str, str]] = []  # (file param, "line N: ...")
    count = 0
    for file_param, line, row in dataset_rows(session, store, project_id, spec):
        if (problem := row_problem(row, spec.method)) is not None:
            count += 1
            if len(problems) < MAX_REPORTED:
                problems.append((file_param, f"{file_param} line {line}: {problem}"))
    if problems:
        more = f" (and {count - len(problems)} more)" if count > len(problems) else ""
        kind = "a supervised" if spec.method == "supervised" else "a cispo or reinforcement"
        raise InvalidRequest(f"{problems[0][0]}: {count} row(s) unusable for {kind} job: "
                             + "; ".join(p for _, p in problems) + more, param=problems[0][0],
                             code="invalid_rows_for_method")
