"""The few calls of MLflow's REST API (2.0) a job's tracker makes, to a tracking server the tenant named.

MLflow's own client resolves the host itself and follows redirects, so a server that passed the API's check
could send the worker anywhere (the cloud metadata endpoint), and its exceptions quote the response body into
the job's events. Here every request goes through service/egress.py's checked path: resolved and vetted when it
is made, sent to the vetted address, never redirected, read up to a cap. Errors name the call and the HTTP
status, never what the server answered, and no operator credentials (MLFLOW_TRACKING_TOKEN, ...) are sent to a
tenant's server.
"""

from __future__ import annotations

import time
from urllib.parse import urlencode

import httpx

from service.egress import EgressPolicy, EgressRefused, request_json

API = "/api/2.0/mlflow"
PARAMS_PER_BATCH = 100  # MLflow's limits on one log-batch call
METRICS_PER_BATCH = 1000
PARAM_CHARS = 6000


class TrackingRequestFailed(Exception):
    """A call to the tracking server failed; the message is ours (call, status or transport error), never the
    server's words."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class MlflowRest:
    def __init__(self, uri: str, policy: EgressPolicy):
        self.base = uri.rstrip("/")
        self.policy = policy
        self.client = httpx.Client(timeout=httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s),
                                   follow_redirects=False)

    def _call(self, method: str, endpoint: str, payload: dict | None = None, *, query: dict | None = None,
              missing_ok: bool = False) -> dict | None:
        url = f"{self.base}{API}/{endpoint}" + (f"?{urlencode(query)}" if query else "")
        try:
            status, answer = request_json(method, url, self.policy, payload=payload, client=self.client)
        except EgressRefused as e:
            raise TrackingRequestFailed(f"MLflow {endpoint}: refused by the egress policy: {e}") from None
        except httpx.HTTPError as e:
            raise TrackingRequestFailed(f"MLflow {endpoint}: {type(e).__name__} reaching {self.base}") from None
        if missing_ok and status == 404:
            return None
        if 300 <= status < 400:
            raise TrackingRequestFailed(f"MLflow {endpoint}: the server answered a redirect (HTTP {status}), "
                                        "which is not followed; name the server's final URL")
        if status >= 400 or not isinstance(answer, dict):
            what = f"HTTP {status}" if status >= 400 else "an answer that is not a JSON object"
            raise TrackingRequestFailed(f"MLflow {endpoint}: the server answered {what} (its body is not shown)")
        return answer

    def experiment_id(self, name: str) -> str:
        """The experiment's id; created when missing."""
        found = self._call("GET", "experiments/get-by-name", query={"experiment_name": name}, missing_ok=True)
        if found is not None:
            return str(found["experiment"]["experiment_id"])
        return str(self._call("POST", "experiments/create", {"name": name})["experiment_id"])

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        found = self._call("POST", "runs/search", {"experiment_ids": [experiment_id], "max_results": 1,
                                                   "filter": f"tags.`{tag}` = '{value}'"})
        runs = found.get("runs") or []
        return str(runs[0]["info"]["run_id"]) if runs else None

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> str:
        run = self._call("POST", "runs/create", {"experiment_id": experiment_id, "run_name": name,
                                                 "start_time": _now_ms(),
                                                 "tags": [{"key": k, "value": v} for k, v in tags.items()]})
        return str(run["run"]["info"]["run_id"])

    def log_params(self, run_id: str, params: dict[str, object]) -> None:
        items = [{"key": k, "value": str(v)[:PARAM_CHARS]} for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self._call("POST", "runs/log-batch", {"run_id": run_id, "params": items[i:i + PARAMS_PER_BATCH]})

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        now = _now_ms()
        items = [{"key": k, "value": v, "timestamp": now, "step": step} for k, v in metrics.items()]
        for i in range(0, len(items), METRICS_PER_BATCH):
            self._call("POST", "runs/log-batch", {"run_id": run_id, "metrics": items[i:i + METRICS_PER_BATCH]})

    def terminate(self, run_id: str, status: str) -> None:
        self._call("POST", "runs/update", {"run_id": run_id, "status": status, "end_time": _now_ms()})

    def close(self) -> None:
        self.client.close()
