"""GET /metrics: Prometheus text for operators (behind CISPO_METRICS_TOKEN), no tenant data beyond job ids."""

from __future__ import annotations

import re

from service.db.models import JobMetric
from tests.service.api.conftest import assert_error, created_job, running_api
from tests.service.api.trained import train

TOKEN = "operator-secret-token"


LABEL = re.compile(r'(\w+)="((?:[^"\\\\]|\\\\.)*)"')


def _sample(text: str, name: str, labels: str = "") -> float:
    """The value of the sample `name{labels}`; labels compare as a set (the exposition may order them otherwise)."""
    wanted = dict(LABEL.findall(labels))
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.partition("{")[0] == name and dict(LABEL.findall(sample.partition("{")[2])) == wanted:
            return float(value)
    raise AssertionError(f"{name}{labels} not in:\n{text}")


def test_metrics_are_off_without_a_token_and_refuse_project_keys(api):
    assert_error(api.client.get("/metrics"), 404, "CISPO_METRICS_TOKEN")


def test_metrics_expose_requests_jobs_queue_and_running_jobs(database_url, tmp_path):
    with running_api(database_url, tmp_path, metrics_token=TOKEN) as api:
        done, running, queued = (created_job(api, metadata={"team": "secret-team-name"}) for _ in range(3))
        train(api.database_url, api.store, done["id"])
        train(api.database_url, api.store, running["id"], status=None, steps=2, checkpoint_step=None)
        with api.session() as s:  # throughput as the trainer records it (the curves the dashboard draws lack it)
            s.add_all([JobMetric(job_id=running["id"], step=step, name="tokens_per_second", value=value)
                       for step, value in ((1, 100.0), (2, 250.0))])
            s.commit()
        api.client.get(f"/v1/fine_tuning/jobs/{queued['id']}")
        api.client.get("/v1/fine_tuning/jobs/ftjob-nonexistent")
        api.client.get("/no/such/route")
        api.client.request("BREW", "/no/such/route")

        assert_error(api.client.get("/metrics"), 401, "CISPO_METRICS_TOKEN")  # a project key is not the token
        assert_error(api.anonymous.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        r = api.anonymous.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text

    route = 'route="/v1/fine_tuning/jobs/{fine_tuning_job_id}"'
    assert _sample(text, "cispo_http_requests_total", f'{{method="GET",{route},status="200"}}') == 1
    assert _sample(text, "cispo_http_requests_total", f'{{method="GET",{route},status="404"}}') == 1
    assert _sample(text, "cispo_http_requests_total", '{method="GET",route="unmatched",status="404"}') == 1
    assert _sample(text, "cispo_http_requests_total", '{method="OTHER",route="unmatched",status="404"}') == 1
    assert "BREW" not in text
    assert _sample(text, "cispo_http_request_duration_seconds_count", f'{{method="GET",{route}}}') == 2
    assert _sample(text, "cispo_http_request_duration_seconds_bucket", f'{{method="GET",{route},le="+Inf"}}') == 2
    assert _sample(text, "cispo_jobs", '{status="succeeded"}') == 1
    assert _sample(text, "cispo_jobs", '{status="running"}') == 1
    assert _sample(text, "cispo_jobs", '{status="failed"}') == 0
    assert _sample(text, "cispo_queue_depth") == 1
    assert _sample(text, "cispo_job_step", f'{{job_id="{running["id"]}"}}') == 2
    assert _sample(text, "cispo_job_reward_mean", f'{{job_id="{running["id"]}"}}') == 0.35  # step 2's, the latest
    assert _sample(text, "cispo_job_tokens_per_second", f'{{job_id="{running["id"]}"}}') == 250.0
    assert "NaN" in [line.split()[-1] for line in text.splitlines()
                     if line.startswith(f'cispo_job_sampled_tokens_per_second{{job_id="{running["id"]}"}}')]
    assert done["id"] not in text and queued["id"] not in text  # only running jobs get gauges
    assert "secret-team-name" not in text and "alpha" not in text and "proj_" not in text
    assert "ftjob-nonexistent" not in text  # raw paths never become labels
