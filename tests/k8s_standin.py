"""A small stand-in of the Kubernetes API on loopback, for the ``kubernetes`` controller's
tests (no cluster runs on these machines).

It implements the endpoints the controller uses: Jobs (create, get, list by label or field
selector, watch, patch, delete) and pods (list by label, with a status a test may set; read
log), and records every request. A
created Job either waits for the test to finish it (``runner="manual"``) or runs its
container command as a local process with the container's environment
(``runner="local"``), so an agent can call the real gateway and post its reward. Tests can
queue error answers for the next creates.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    at: float


@dataclass
class StandIn:
    runner: str = "manual"                       # manual | local
    jobs: dict[str, dict] = field(default_factory=dict)       # name -> Job (camelCase JSON)
    logs: dict[str, str] = field(default_factory=dict)        # job name -> pod log
    requests: list[Recorded] = field(default_factory=list)
    create_errors: list[tuple[int, str]] = field(default_factory=list)  # next creates answer
    read_errors: int = 0  # the next reads of a Job answer 503 (the API server away)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    version: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)
    events: list[tuple[int, str, dict]] = field(default_factory=list)  # (version, type, job)
    pod_status: dict[str, dict] = field(default_factory=dict)  # job name -> its pod's status
    # job name -> why the Job controller cannot create its pod (no pod; a FailedCreate event)
    create_refused: dict[str, str] = field(default_factory=dict)

    # --- what tests call -------------------------------------------------------------------

    def created(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("/jobs")]

    def deleted(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "DELETE"]

    def finish(self, name: str, succeeded: bool, reason: str = "BackoffLimitExceeded",
               message: str = "", log: str = "") -> None:
        with self.cond:
            job = self.jobs[name]
            self.logs[name] = self.logs.get(name, "") + log
            status = job.setdefault("status", {})
            status.pop("active", None)
            if succeeded:
                status["succeeded"] = 1
                status["conditions"] = [{"type": "Complete", "status": "True"}]
            else:
                status["failed"] = 1
                status["conditions"] = [{"type": "Failed", "status": "True",
                                         "reason": reason, "message": message}]
            self._event("MODIFIED", job)

    # --- internals -------------------------------------------------------------------------

    def _event(self, kind: str, job: dict) -> None:
        self.version += 1
        job.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, copy.deepcopy(job)))
        self.cond.notify_all()

    def _run_local(self, name: str) -> None:
        job = self.jobs[name]
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {**os.environ, **{e["name"]: e.get("value", "") for e in container.get("env", [])}}
        log = tempfile.TemporaryFile()  # the pod's log, read when it ends
        proc = subprocess.Popen(container["command"] + container.get("args", []), env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        started = time.monotonic()

        def watch() -> None:
            # activeDeadlineSeconds is read on every tick: a patch may move it
            timed_out = False
            while proc.poll() is None:
                deadline = (self.jobs.get(name) or job)["spec"].get("activeDeadlineSeconds")
                if deadline is not None and time.monotonic() - started > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    timed_out = True
                    break
                time.sleep(0.05)
            proc.wait()
            log.seek(0)
            out = log.read().decode("utf-8", "replace")
            log.close()
            if name not in self.jobs:
                return  # deleted meanwhile
            if timed_out:
                self.finish(name, False, "DeadlineExceeded",
                            "Job was active longer than specified deadline", out)
            else:
                self.finish(name, proc.returncode == 0, message=f"exit code {proc.returncode}",
                            log=out)

        threading.Thread(target=watch, daemon=True).start()


def _matches(job: dict, label_selector: str | None, field_selector: str | None) -> bool:
    labels = job["metadata"].get("labels") or {}
    for term in filter(None, (label_selector or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    for term in filter(None, (field_selector or "").split(",")):
        k, _, v = term.partition("=")
        if k != "metadata.name" or job["metadata"]["name"] != v:
            return False
    return True


def _status(code: int, reason: str, message: str) -> Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return Response(json.dumps(body), status=code, mimetype="application/json")


def create_app(s: StandIn) -> Flask:
    app = Flask("k8s-standin")
    jobs_path = "/apis/batch/v1/namespaces/<ns>/jobs"

    @app.before_request
    def record() -> None:
        body = request.get_json(silent=True) if request.data else None
        s.requests.append(Recorded(request.method, request.path, dict(request.args), body,
                                   time.time()))

    @app.post(jobs_path)
    def create_job(ns: str):
        if s.create_errors:
            code, message = s.create_errors.pop(0)
            return _status(code, "Invalid" if code == 422 else "ServiceUnavailable", message)
        job = request.get_json()
        name = job["metadata"]["name"]
        with s.cond:
            if name in s.jobs:
                return _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            meta = job["metadata"]
            meta.update(namespace=ns, uid=str(uuid.uuid4()),
                        creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            job["status"] = {"active": 1}
            s.jobs[name] = job
            s._event("ADDED", job)
        if s.runner == "local":
            s._run_local(name)
        return jsonify(job), 201

    @app.get(jobs_path)
    def list_jobs(ns: str):
        ls, fs = request.args.get("labelSelector"), request.args.get("fieldSelector")
        if request.args.get("watch") in ("true", "True", "1"):
            timeout = float(request.args.get("timeoutSeconds", 30))
            return Response(_watch(s, ls, fs, timeout), mimetype="application/json")
        with s.cond:
            items = [copy.deepcopy(j) for j in s.jobs.values() if _matches(j, ls, fs)]
            return jsonify({"kind": "JobList", "apiVersion": "batch/v1",
                            "metadata": {"resourceVersion": str(s.version)}, "items": items})

    @app.get(jobs_path + "/<name>")
    def get_job(ns: str, name: str):
        with s.cond:
            if s.read_errors > 0:
                s.read_errors -= 1
                return _status(503, "ServiceUnavailable", "the API server is restarting")
            if name not in s.jobs:
                return _status(404, "NotFound", f'jobs.batch "{name}" not found')
            return jsonify(s.jobs[name])

    @app.patch(jobs_path + "/<name>")
    def patch_job(ns: str, name: str):
        patch = request.get_json(force=True)
        with s.cond:
            if name not in s.jobs:
                return _status(404, "NotFound", f'jobs.batch "{name}" not found')
            job = s.jobs[name]
            unknown = set(patch) - {"spec"} or set(patch.get("spec", {})) - {
                "activeDeadlineSeconds"}
            if unknown:  # the only field the controller changes
                return _status(422, "Invalid", f"stand-in cannot patch {sorted(unknown)}")
            job["spec"].update(patch["spec"])
            s._event("MODIFIED", job)
            return jsonify(job)

    @app.delete(jobs_path + "/<name>")
    def delete_job(ns: str, name: str):
        with s.cond:
            job = s.jobs.pop(name, None)
            if job is None:
                return _status(404, "NotFound", f'jobs.batch "{name}" not found')
            s._event("DELETED", job)
        proc = s.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the pods go with the Job
        return jsonify({"kind": "Status", "apiVersion": "v1", "status": "Success"})

    @app.get("/api/v1/namespaces/<ns>/pods")
    def list_pods(ns: str):
        selector = request.args.get("labelSelector", "")
        name = selector.removeprefix("job-name=")
        items = []
        if (name in s.jobs or name in s.logs) and name not in s.create_refused:
            items.append({"metadata": {"name": f"{name}-pod", "namespace": ns,
                                       "labels": {"job-name": name}},
                          "status": s.pod_status.get(name, {"phase": "Running"})})
        return jsonify({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    @app.get("/api/v1/namespaces/<ns>/events")
    def list_events(ns: str):
        fields = dict(f.split("=", 1) for f in request.args.get("fieldSelector", "").split(",")
                      if "=" in f)
        name = fields.get("involvedObject.name", "")
        items = []
        if name in s.create_refused and fields.get("involvedObject.kind", "Job") == "Job":
            items.append({"metadata": {"name": f"{name}.17", "namespace": ns},
                          "involvedObject": {"kind": "Job", "name": name, "namespace": ns},
                          "reason": "FailedCreate", "type": "Warning",
                          "message": s.create_refused[name]})
        return jsonify({"kind": "EventList", "apiVersion": "v1", "metadata": {},
                        "items": items})

    @app.get("/api/v1/namespaces/<ns>/pods/<pod>/log")
    def pod_log(ns: str, pod: str):
        return Response(s.logs.get(pod.removesuffix("-pod"), ""), mimetype="text/plain")

    return app


def _watch(s: StandIn, ls: str | None, fs: str | None, timeout: float):
    """Current matching Jobs as ADDED, then every later change, until the timeout."""
    with s.cond:
        start = s.version
        first = [copy.deepcopy(j) for j in s.jobs.values() if _matches(j, ls, fs)]
    for job in first:
        yield json.dumps({"type": "ADDED", "object": job}) + "\n"
    seen = start
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with s.cond:
            s.cond.wait(timeout=min(0.2, max(0.0, end - time.monotonic())))
            new = [e for e in s.events if e[0] > seen]
        for version, kind, job in new:
            seen = version
            if _matches(job, ls, fs):
                yield json.dumps({"type": kind, "object": job}) + "\n"


class Server:
    """The stand-in served on a free loopback port in a thread; ``kubeconfig`` writes a
    kubeconfig file that points the official client at it."""

    def __init__(self, standin: StandIn) -> None:
        self.standin = standin
        self.http = make_server("127.0.0.1", 0, create_app(standin), threaded=True)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.standin.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        self.http.shutdown()

    def kubeconfig(self, path: str) -> str:
        conf = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "standin-token"}}],
            "contexts": [{"name": "standin",
                          "context": {"cluster": "standin", "user": "tester"}}],
        }
        with open(path, "w") as fh:
            json.dump(conf, fh)  # JSON is YAML
        return path
