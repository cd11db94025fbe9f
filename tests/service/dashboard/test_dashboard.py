"""The dashboard in a real headless Chromium against a real uvicorn API: jobs, curves, samples, events,
checkpoints and controls render from the public API; user-provided text stays text; the CSP holds."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

from service.db.models import JobMetric
from service.repositories import job_records, jobs as jobs_repo
from service.db.session import session_factory
from tests.service.dashboard.browser import Browser, chromium_path
from tests.service.api.conftest import TRAIN_ROWS, cispo_body, jsonl
from tests.service.api.live_server import live_api
from tests.service.api.trained import CURVES, train

XSS_EVENT = '<img src=x onerror="window.__xss = 1">reward error'
XSS_COMPLETION = "<script>window.__xss = 2</script>alpha"
# Installed before any page script runs: collects CSP violations, so the test sees the page obeys its own policy.
CSP_WATCH = ("window.__csp = []; document.addEventListener('securitypolicyviolation', "
             "e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));")


def _sample(completion: str, reward: float) -> dict:
    return {"prompt": "Say alpha", "completion": completion, "reward": reward, "advantage": reward - 0.5,
            "rewards": {"exact_match": reward}}


@pytest.fixture
def populated(tmp_path):
    """A live API with a succeeded job (metrics, events, a checkpoint, samples) and a running one."""
    chromium_path()
    with live_api(tmp_path) as live:
        with live.client() as client:
            upload = client.post("/v1/files", files={"file": ("train.jsonl", jsonl(TRAIN_ROWS))},
                                 data={"purpose": "fine-tune"}).json()
            done, running = (client.post("/v1/fine_tuning/jobs", json=cispo_body(upload["id"])).json()
                             for _ in range(2))
        ckpt = train(live.database_url, live.store, done["id"],
                     samples={2: [_sample("beta", 0.0)], 3: [_sample(XSS_COMPLETION, 1.0)]},
                     checkpoint_metrics={"reward_mean": 0.6, "eval_reward_mean": 0.5, "eval_reward_ci_low": 0.3,
                                         "eval_reward_ci_high": 0.7, "eval_rows": 10})
        lease = train(live.database_url, live.store, running["id"], status=None, steps=2, checkpoint_step=None)
        with session_factory(live.database_url).begin() as s:
            jobs_repo.add_event(s, done["id"], XSS_EVENT, level="warn")
        with live.client() as client:
            served = client.get(f"/v1/fine_tuning/jobs/{done['id']}/samples").json()["data"]
        assert [(x["step"], x["completion"]) for x in served] == [(3, XSS_COMPLETION), (2, "beta")]
        yield live, done["id"], running["id"], ckpt, lease["epoch"]


def _vertices(d: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d)]


def test_dashboard_renders_a_jobs_curves_samples_events_and_checkpoints(populated, tmp_path):
    live, done, running, ckpt, epoch = populated
    with live.client() as client:
        page = client.get("/dashboard")
    csp = page.headers["content-security-policy"]
    assert page.status_code == 200 and "script-src 'self'" in csp and "unsafe-inline" not in csp

    long_model = "anorganisationwithalongname/" + "amodelwithaverylongnamethatnobrowserbreaks" * 2  # no hyphens
    with live.client() as client:  # a long id in the jobs table must not push it sideways
        upload = client.post("/v1/files", files={"file": ("train.jsonl", jsonl(TRAIN_ROWS))},
                             data={"purpose": "fine-tune"}).json()
        wide = client.post("/v1/fine_tuning/jobs", json=cispo_body(upload["id"], model=long_model)).json()
        assert wide["model"] == long_model, wide
    with session_factory(live.database_url).begin() as s:  # the evaluations a worker records (steps 0 and 3)
        s.add_all([JobMetric(job_id=done, step=step, name="eval_reward_mean", value=v) for step, v in ((0, 0.25), (3, 0.5))])

    browser = Browser(tmp_path / "profile")
    try:
        downloads = tmp_path / "downloads"
        browser.call("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)},
                     page=False)
        browser.call("Page.enable")
        browser.call("Page.addScriptToEvaluateOnNewDocument", {"source": CSP_WATCH})
        browser.call("Page.navigate", {"url": f"{live.base}/dashboard#{done}"})
        browser.wait_for("document.readyState === 'complete'")
        assert "Enter your API key" in browser.wait_for("document.getElementById('notice').textContent")
        # A link that carries the key in its fragment: the page takes it, keeps it, and drops it from the address.
        browser.call("Page.navigate", {"url": f"{live.base}/dashboard#key={live.key}&job={done}"})
        browser.wait_for("document.body.dataset.loaded === 'true' && document.querySelectorAll('.sample').length")
        assert browser.evaluate("[location.hash, localStorage.getItem('cispo.apiKey')]") == [f"#{done}", live.key]
        assert live.key not in json.dumps(browser.evaluate("[location.href, history.length]"))

        rows = browser.evaluate("[...document.querySelectorAll('#jobs tbody tr')].map(r => [r.dataset.job, "
                                "r.querySelector('.status').textContent, r.querySelector('.progress').textContent])")
        assert rows[1:] == [[running, "running", " 2/3"], [done, "succeeded", " 3/3"]]
        assert browser.evaluate("(p => p.scrollWidth <= p.clientWidth)(document.getElementById('jobs-panel'))")
        with live.client() as client:
            fine_tuned = client.get(f"/v1/fine_tuning/jobs/{done}").json()["fine_tuned_model"]
        assert browser.evaluate(f"document.querySelector('#jobs tr[data-job={json.dumps(done)}] .fine-tuned')"
                                ".textContent") == fine_tuned
        # Each row's progress stays inside its cell, left of Created; Created shows its whole 24-hour time.
        layout = browser.evaluate("[...document.querySelectorAll('#jobs tbody tr')].map(r => ({progress: "
                                  "r.querySelector('.progress').getBoundingClientRect().right, created: "
                                  "r.cells[3].getBoundingClientRect().left, text: r.cells[3].textContent, "
                                  "fits: r.cells[3].scrollWidth <= r.cells[3].clientWidth}))")
        for row in layout:
            assert row["progress"] <= row["created"] and row["fits"], row
            assert re.fullmatch(r"\w+ \d+, \d\d:\d\d", row["text"]), row

        charts = browser.evaluate("[...document.querySelectorAll('#charts figure')].map(f => ({metric: "
                                  "f.dataset.metric, d: f.querySelector('path').getAttribute('d'), points: "
                                  "[...f.querySelectorAll('circle title')].map(t => t.textContent)}))")
        assert [c["metric"] for c in charts] == ["reward_mean", "eval_reward_mean", "kl_old", "clip_fraction", "loss"]
        assert browser.evaluate("[...document.querySelectorAll('#charts .tick')].every(t => t.getBBox().x >= 0)")
        assert charts[1]["points"] == ["step 0: 0.25", "step 3: 0.5"]
        titles = browser.evaluate("[...document.querySelectorAll('#charts figcaption')].map(c => c.textContent)")
        assert titles[2].startswith("KL to the rollout policy (kl_old)")  # not "to reference": kl_old is not that
        for chart in (c for c in charts if c["metric"] != "eval_reward_mean"):
            values = CURVES[chart["metric"]]
            assert chart["points"] == [f"step {i + 1}: {v:g}" for i, v in enumerate(values)]
            xs, ys = zip(*_vertices(chart["d"]))
            assert len(xs) == len(values) and list(xs) == sorted(xs)
            # SVG y grows downwards: the order of the heights is the reverse order of the values.
            assert sorted(range(len(ys)), key=lambda i: -ys[i]) == sorted(range(len(values)), key=values.__getitem__)

        completions = browser.evaluate("[...document.querySelectorAll('.sample .completion')].map(p => p.textContent)")
        assert completions == [XSS_COMPLETION, "beta"]
        assert "step 3 · reward 1 · advantage 0.5" in browser.evaluate("document.querySelector('.sample').textContent")
        events = browser.evaluate("[...document.querySelectorAll('#events .message')].map(m => m.textContent)")
        assert events[0] == XSS_EVENT and "Checkpoint saved at step 3" in events and "Job created" in events
        # Shown as text, never parsed: no injected element exists and neither payload ran.
        assert browser.evaluate("document.querySelectorAll('#samples script, #events img').length") == 0
        assert browser.evaluate("window.__xss === undefined") is True
        assert browser.evaluate("window.__csp") == []
        checkpoints = browser.evaluate("[...document.querySelectorAll('#checkpoints tbody tr')].map(r => "
                                       "[...r.cells].map(c => c.textContent))")
        # The checkpoint's own eval (reward 0.5 and its interval), not its step's training reward (0.6).
        assert checkpoints == [["3", ckpt["checkpoint"], "reward 0.5 [0.3, 0.7]", "Download adapter"]]
        assert browser.evaluate("[document.getElementById('pause').disabled, "
                                "document.getElementById('cancel').disabled]") == [True, True]

        shot = browser.screenshot(tmp_path / "dashboard.png")
        if target := os.environ.get("CISPO_DASHBOARD_SCREENSHOT"):
            shutil.copy(shot, target)

        browser.evaluate("document.querySelector('#checkpoints button.download').click()")
        saved = downloads / f"{ckpt['checkpoint']}-adapter.tar"
        browser.wait_for(f"document.getElementById('notice').textContent.includes({json.dumps(ckpt['sha256'])})")
        deadline = time.monotonic() + 10
        while not saved.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert saved.read_bytes() == ckpt["tar"]

        # Another job, chosen by editing the #job-id: no samples (the endpoint 404s for it) and live controls
        # that act through the API.
        browser.evaluate(f"location.hash = '#{running}'")
        browser.wait_for(f"document.getElementById('job-title').textContent.includes('{running}') && "
                         "document.getElementById('samples').textContent === 'No samples yet.'")
        browser.evaluate("document.getElementById('pause').click()")
        with live.client() as client:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                events = client.get(f"/v1/fine_tuning/jobs/{running}/events").json()["data"]
                if events[0]["message"].startswith("Pause requested"):
                    break
                time.sleep(0.2)
            assert events[0]["message"].startswith("Pause requested")
        browser.wait_for("document.getElementById('notice').textContent === 'Asked the job to pause.'")

        # While the job runs the page refreshes itself: a step the worker records shows up without a reload.
        assert browser.evaluate("document.querySelector('#charts path').dataset.points") == "2"
        with session_factory(live.database_url).begin() as s:
            assert job_records.record_step(s, running, epoch, 3, {"reward_mean": 0.9}, trained_tokens=1, ttl_s=600)
        browser.wait_for("document.querySelector('#charts path').dataset.points === '3' && "
                         "document.getElementById('job-summary').textContent.includes('step 3 of 3')", timeout=15)
    finally:
        browser.close()
    assert live.key not in live.log.read_text()  # the key travels in a header only: never in an access log


def test_dashboard_assets_are_a_fixed_list(populated):
    live = populated[0]
    with live.client() as client:
        assert client.get("/dashboard/static/app.js").headers["content-type"].startswith("text/javascript")
        for name in ("index.html", "..%2Froutes.py", "../routes.py"):
            assert client.get(f"/dashboard/static/{name}").status_code == 404
        icon = client.get("/favicon.ico")  # what every browser asks for first
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.content.startswith(b"<svg")
