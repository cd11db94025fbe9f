"""The documentation's examples (README.md and docs/) against the code: the job-spec YAML validates and shows the
real defaults, and the Deploy section's commands are ones the CLI and the compose file have."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from service.job_spec.spec import JobSpec, LoraSpec
from tests.project_docs import docs_text, section


def _spec_block() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", docs_text(), flags=re.S)
    [block] = [b for b in blocks if b.startswith("model:")]
    return yaml.safe_load(block)


def test_the_readme_job_spec_validates_and_shows_the_default_target_modules():
    raw = _spec_block()
    JobSpec.model_validate(raw)
    assert raw["lora"]["target_modules"] == LoraSpec().target_modules  # the YAML shows what you get by default
    training = JobSpec.model_validate(raw).training
    assert (training.preflight_groups, training.no_signal_steps, training.fail_on_no_signal) == (2, 5, False)


def test_the_readme_has_a_deploy_section_for_compose_and_the_chart():
    deploy = section("Deploy")
    assert "docker compose up -d --build" in deploy and "docker compose run --rm migrate cispo keys create" in deploy
    assert "helm install cispo helm/cispo" in deploy
    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    assert "migrate" in compose["services"]
