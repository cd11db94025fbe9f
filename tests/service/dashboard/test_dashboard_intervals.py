"""The dashboard's eval chart draws each eval's 95% interval: the data the page fetches (its own metrics query,
answered by the real API) and what its chart code draws from it, run in node with a minimal DOM (the full
page in Chromium is tests/service/dashboard/test_dashboard.py, skipped where Chromium is not installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from service.db.session import session_factory
from service.repositories import job_lease, job_records
from tests.service.api.conftest import created_job

SCRIPT = Path(__file__).parent / "js" / "dashboard_charts.js"
APP_JS = Path(__file__).parents[3] / "service" / "dashboard" / "static" / "app.js"
EVALS = {0: (0.25, 0.10, 0.45), 2: (0.50, 0.30, 0.70), 4: (0.75, 0.55, 0.90)}  # step: mean, low, high


def _draw(tmp_path, answers: dict) -> dict:
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    out = subprocess.run(["node", str(SCRIPT), str(APP_JS), str(tmp_path / "answers.json")], capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_eval_chart_draws_each_evals_interval(api, tmp_path):
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    job_id = created_job(api)["id"]
    with session_factory(api.database_url).begin() as s:
        epoch = job_lease.claim(s, job_id, "test-worker", ttl_s=600)
    for step in range(0, 5):
        values = {"reward_mean": 0.1 * step} if step else {}
        if step in EVALS:
            mean, low, high = EVALS[step]
            values |= {"eval_reward_mean": mean, "eval_reward_ci_low": low, "eval_reward_ci_high": high}
        with session_factory(api.database_url).begin() as s:
            assert job_records.record_step(s, job_id, epoch, step, values, trained_tokens=10 if step else 0, ttl_s=600)

    # The page's own query (asked of a fetch that knows no answer yet), answered by the real API.
    [url] = _draw(tmp_path, {})["asked"]
    assert url.startswith("/v1/fine_tuning/jobs/job/metrics?")
    names = [unquote(p.split("=", 1)[1]) for p in url.split("?", 1)[1].split("&") if p.startswith("name=")]
    assert {"eval_reward_mean", "eval_reward_ci_low", "eval_reward_ci_high"} <= set(names)
    served = api.client.get(url.replace("/jobs/job/", f"/jobs/{job_id}/", 1))
    assert served.status_code == 200, served.text
    points = {(p["step"], p["name"]): p["value"] for p in served.json()["data"]}
    for step, (mean, low, high) in EVALS.items():
        assert (points[step, "eval_reward_ci_low"], points[step, "eval_reward_ci_high"]) == (low, high)

    drawn = {c["metric"]: c for c in _draw(tmp_path, {url: served.json()})["charts"]}
    evals = drawn["eval_reward_mean"]
    assert [i["step"] for i in evals["intervals"]] == sorted(EVALS)
    for dot, bar, (mean, low, high) in zip(evals["dots"], evals["intervals"], EVALS.values()):
        assert bar["x"] == pytest.approx(dot["cx"])
        assert bar["y_low"] > dot["cy"] > bar["y_high"]  # SVG y grows downward: low below the mean, high above
    # bar lengths are in proportion to the interval widths (one axis for the whole chart)
    heights = [b["y_low"] - b["y_high"] for b in evals["intervals"]]
    widths = [high - low for _, low, high in EVALS.values()]
    assert [h / heights[0] for h in heights] == pytest.approx([w / widths[0] for w in widths], rel=1e-3)
    assert drawn["reward_mean"]["intervals"] == []  # the train reward has no interval to draw


def test_a_supervised_job_draws_its_losses_and_no_empty_reinforcement_charts(tmp_path):
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    job = {"id": "job", "method": {"type": "supervised", "supervised": {"hyperparameters": {}}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "answers.json").write_text("{}")
    [url] = json.loads(subprocess.run(["node", str(SCRIPT), str(APP_JS), str(tmp_path / "answers.json"),
                                       str(tmp_path / "job.json")], capture_output=True, text=True,
                                      timeout=60).stdout.strip().splitlines()[-1])["asked"]
    names = {unquote(p.split("=", 1)[1]) for p in url.split("?", 1)[1].split("&") if p.startswith("name=")}
    assert names == {"loss", "eval_loss"}
    served = {"object": "list", "has_more": False, "data": [
        {"step": s, "name": n, "value": v} for s, n, v in ((1, "loss", 2.0), (2, "loss", 1.5), (2, "eval_loss", 1.7))]}
    (tmp_path / "answers.json").write_text(json.dumps({url: served}))
    out = subprocess.run(["node", str(SCRIPT), str(APP_JS), str(tmp_path / "answers.json"), str(tmp_path / "job.json")],
                         capture_output=True, text=True, timeout=60)
    charts = json.loads(out.stdout.strip().splitlines()[-1])["charts"]
    assert [(c["metric"], len(c["dots"])) for c in charts] == [("loss", 2), ("eval_loss", 1)]


def test_an_axis_label_of_a_large_value_is_short_and_fits_its_margin(tmp_path):
    """A kl_old peak of 111.4895 was labelled "11.4895": the label ran past the chart's fixed left margin."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    [url] = _draw(tmp_path, {})["asked"]
    served = {"object": "list", "has_more": False, "data": [
        {"step": s, "name": "kl_old", "value": v} for s, v in ((1, 0.02), (2, 22.1), (3, 111.4895))]}
    [kl] = [c for c in _draw(tmp_path, {url: served})["charts"] if c["metric"] == "kl_old"]
    assert [t["text"] for t in kl["ticks"]] == ["0.02", "55.75", "111.5"]
    for label in kl["ticks"]:  # right-aligned at x: 11px digits need under 7px each to its left
        assert label["x"] >= 7 * len(label["text"]), label
