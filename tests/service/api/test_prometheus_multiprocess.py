"""Several API worker processes behind one port: a scrape answered by any one of them counts every one's requests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# A worker process: its own RequestMetrics, `n` requests on one route, then the exposition it would serve.
WORKER = """
import sys
from prometheus_client import generate_latest
from service.api.request_metrics import RequestMetrics
metrics = RequestMetrics()
for _ in range(int(sys.argv[1])):
    metrics.observe("GET", "/v1/files", 200, 0.02)
sys.stdout.write(generate_latest(metrics.registry()).decode())
"""


def _worker(n: int, multiproc_dir: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(REPO)
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    return subprocess.run([sys.executable, "-c", WORKER, str(n)], env=env, check=True, capture_output=True,
                          text=True, timeout=120).stdout


def _sample(text: str, line_start: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    assert len(values) == 1, f"{line_start} in:\n{text}"
    return values[0]


def test_multiprocess_mode_sums_every_workers_counters(tmp_path):
    _worker(2, tmp_path)
    text = _worker(3, tmp_path)  # the process that answers the scrape saw 3 of the 5
    labels = '{method="GET",route="/v1/files",status="200"}'
    assert _sample(text, f"cispo_http_requests_total{labels}") == 5
    assert _sample(text, 'cispo_http_request_duration_seconds_count{method="GET",route="/v1/files"}') == 5
    assert _sample(text, 'cispo_http_request_duration_seconds_bucket{le="0.025",method="GET",route="/v1/files"}'
                   ) == 5


def test_without_the_directory_each_process_counts_its_own(tmp_path):
    _worker(2, None)
    text = _worker(3, None)
    assert _sample(text, 'cispo_http_requests_total{method="GET",route="/v1/files",status="200"}') == 3
