"""The ``kubernetes`` controller against a local stand-in of the Kubernetes API (the real
``kubernetes`` client, real HTTP, real Redis for the creation pacing)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.config import load_config
from app.state import keys
from tests.k8s_standin import Server, StandIn
from workers.rollout.controller import AgentError, LLMEndpoint, PauseAwareClock
from workers.rollout.kubernetes import (
    ANNOTATION_ROLLOUT,
    KubernetesController,
    build_job,
    job_name,
)

RUN, GROUP = "20261129-120000-ab12", "20261129-120000-ab12-g7"


@pytest.fixture
def standin():
    s = StandIn()
    with Server(s) as server:
        yield s, server


def make_cfg(tmp_path: Path, server: Server, *overrides: str) -> Any:
    kubeconfig = server.kubeconfig(str(tmp_path / f"kubeconfig-{time.monotonic_ns()}"))
    return load_config(None, [
        "controller.backend=kubernetes", "controller.agent=python -m examples.reverse.main",
        f"controller.kubernetes.kubeconfig={kubeconfig}",
        "controller.kubernetes.namespace=agents", "controller.kubernetes.image=agents:1.0",
        "controller.kubernetes.service_account=agent-runner",
        "controller.kubernetes.node_selector={pool: cpu}",
        "controller.kubernetes.labels={team: rl}",
        'controller.kubernetes.resources={limits: {cpu: "1", memory: 1Gi}}',
        "controller.kubernetes.watch_timeout_s=1", *overrides])


def endpoint(index: int = 0, attempt_hex: str = "0a1b2c3d") -> LLMEndpoint:
    rid = f"{GROUP}.{index}.{attempt_hex}"
    return LLMEndpoint(base_url=f"http://gw.test:8200/rollout/{rid}/v1",
                       api_key="secret-token", model="policy", rollout_id=rid)


def controller(cfg: Any, redis_client, index: int = 0) -> KubernetesController:
    return KubernetesController(cfg.controller.agent, {"tool_median_s": 0},
                                cfg.controller.kubernetes, client=redis_client,
                                gateway_url="http://gw.test:8200", run_id=RUN,
                                group_id=GROUP, index=index)


def run_async(ctl: KubernetesController, llm: LLMEndpoint, *, timeout_s: float = 60,
              cancelled=lambda: False, posted=lambda: None, adopted: bool = False) -> dict:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["reward"] = ctl.run({"text": "abc", "target": "cba"}, llm, timeout_s,
                                    PauseAwareClock(lambda: False), cancelled,
                                    posted_reward=posted, adopted=adopted)
        except AgentError as exc:
            box["error"] = exc

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def finish(box: dict, timeout: float = 30.0) -> dict:
    box["thread"].join(timeout)
    assert not box["thread"].is_alive(), "controller did not return"
    return box


def started_job(tmp_path, standin, redis_client, **run_kw) -> tuple[StandIn, str, dict]:
    """A controller run in a thread, returned once its Job exists in the stand-in:
    (stand-in, Job name, box of the run)."""
    s, server = standin
    llm = endpoint()
    box = run_async(controller(make_cfg(tmp_path, server), redis_client), llm, **run_kw)
    name = job_name(llm.rollout_id)
    wait_for(lambda: name in s.jobs)
    return s, name, box


def test_manifest_fields_and_client_model_round_trip(tmp_path, standin):
    from kubernetes.client import ApiClient

    _, server = standin
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.env={EXTRA: x}")
    llm = endpoint()
    job = build_job(cfg.controller.kubernetes, command=cfg.controller.agent, llm=llm,
                    gateway_url="http://gw.cluster:8200", sample={"text": "abc"},
                    settings={"k": 1}, run_id=RUN, group_id=GROUP, index=0, attempt=2,
                    timeout_s=100)
    api = ApiClient()
    body = api.sanitize_for_serialization(job)
    spec = body["spec"]
    assert body["metadata"]["name"] == job_name(llm.rollout_id)
    assert len(body["metadata"]["name"]) <= 63
    assert body["metadata"]["annotations"][ANNOTATION_ROLLOUT] == llm.rollout_id
    labels = body["metadata"]["labels"]
    assert labels == {"team": "rl", "app.kubernetes.io/managed-by": "carryover",
                      "carryover.io/run": RUN, "carryover.io/group": GROUP,
                      "carryover.io/index": "0", "carryover.io/attempt": "2"}
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 160  # rollout timeout + deadline_slack_s
    assert spec["ttlSecondsAfterFinished"] == 600
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"] == labels
    assert pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "agent-runner"
    # agent code gets no Kubernetes API token unless the config asks for one
    assert pod["automountServiceAccountToken"] is False
    assert pod["nodeSelector"] == {"pool": "cpu"}
    container = pod["containers"][0]
    assert container["image"] == "agents:1.0"
    assert container["command"] == ["/bin/sh", "-c", "python -m examples.reverse.main"]
    assert container["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"}}
    env = {e["name"]: e["value"] for e in container["env"]}
    base = f"http://gw.cluster:8200/rollout/{llm.rollout_id}"
    assert env["OPENAI_BASE_URL"] == base + "/v1"
    assert env["CARRYOVER_REWARD_URL"] == base + "/reward"
    assert env["OPENAI_API_KEY"] == "secret-token" and env["OPENAI_MODEL"] == "policy"
    assert json.loads(env["CARRYOVER_SAMPLE"]) == {"text": "abc"}
    assert json.loads(env["CARRYOVER_AGENT_SETTINGS"]) == {"k": 1} and env["EXTRA"] == "x"
    assert float(env["CARRYOVER_MAX_WAIT_S"]) == llm.max_wait_s  # the agent's retry budget

    class Raw:
        data = json.dumps(body)

    # the client's own models read it back unchanged (required fields, types)
    again = api.deserialize(Raw(), "V1Job")
    assert api.sanitize_for_serialization(again) == body
    # and the models refuse a container without a name
    from kubernetes.client import V1Container
    with pytest.raises(ValueError, match="name"):
        V1Container(name=None, image="x")


def test_an_agent_secret_comes_from_a_kubernetes_secret(tmp_path, standin):
    """An API key the agent needs (a tool's, say) is named as a Secret's key, so it never
    stands in the Job spec, which anyone who can read Jobs reads."""
    _, server = standin
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.env={PLAIN: x, "
                   "TOOL_KEY: {secret: agent-keys, key: tool}}")
    from kubernetes.client import ApiClient

    job = build_job(cfg.controller.kubernetes, command="true", llm=endpoint(),
                    gateway_url="http://gw", sample={}, settings={}, run_id=RUN,
                    group_id=GROUP, index=0, attempt=1, timeout_s=10)
    env = ApiClient().sanitize_for_serialization(job)["spec"]["template"]["spec"][
        "containers"][0]["env"]
    by_name = {e["name"]: e for e in env}
    # what the config refuses to name is what carryover sets
    from app.config.validate import AGENT_JOB_ENV

    assert set(by_name) - {"PLAIN", "TOOL_KEY"} == set(AGENT_JOB_ENV)
    assert by_name["PLAIN"] == {"name": "PLAIN", "value": "x"}
    assert by_name["TOOL_KEY"] == {"name": "TOOL_KEY", "valueFrom": {
        "secretKeyRef": {"name": "agent-keys", "key": "tool"}}}


@pytest.mark.parametrize("value", ["{secret: agent-keys}", "{secret: s, key: k, x: 1}", "3"])
def test_an_env_value_neither_text_nor_a_secret_is_refused(value):
    from app.config import ConfigError

    with pytest.raises(ConfigError, match="controller.kubernetes.env"):
        load_config(None, [f"controller.kubernetes.env={{TOOL_KEY: {value}}}"])


@pytest.mark.parametrize("override, says", [
    ("controller.kubernetes.env={OPENAI_BASE_URL: http://x}", "which carryover sets"),
    ("controller.kubernetes.env={CARRYOVER_SAMPLE: {secret: s, key: k}}",
     "which carryover sets"),
    ("controller.kubernetes.resources={limit: {cpu: 1}}", "unknown keys ['limit']"),
    ("controller.kubernetes.resources={limits: 3}", "not mapping each resource"),
    ("controller.kubernetes.namespace=My_Agents", "Kubernetes namespace name"),
    ("controller.kubernetes.labels={'bad key!': x}", "label keys Kubernetes refuses"),
])
def test_job_settings_kubernetes_would_refuse_are_config_errors(override, says):
    """Each was found only when a rollout built its Job (every attempt failing, or a
    TypeError), or an env value was silently overwritten by carryover's own."""
    from app.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    (line,) = err.value.problems
    assert line.startswith(override.split("=")[0] + ":") and says in line, line


def test_the_api_client_keeps_a_connection_per_waiting_rollout(tmp_path, standin):
    """Every rollout slot of a worker holds a watch: the client's default pool (5 per CPU)
    would drop and reopen a TLS connection per request past it."""
    from workers.rollout.kubernetes import API_POOL_SIZE, api_client

    _, server = standin
    api = api_client(server.kubeconfig(str(tmp_path / "kubeconfig-pool")), None)
    assert api.rest_client.pool_manager.connection_pool_kw["maxsize"] == API_POOL_SIZE >= 64


def test_long_ids_make_valid_names():
    name = job_name("Run_With.Odd/Chars-" + "x" * 80 + ".3.ab")
    assert len(name) <= 63 and name.startswith("co-")
    assert all(c.isalnum() and c.islower() or c.isdigit() or c == "-" for c in name)
    assert job_name("a" * 100) != job_name("a" * 101)


def test_job_succeeds_with_posted_reward(tmp_path, standin, redis_client):
    s, name, box = started_job(tmp_path, standin, redis_client, posted=lambda: 0.75)
    assert s.created()[0].path == "/apis/batch/v1/namespaces/agents/jobs"
    assert s.created()[0].body["spec"]["backoffLimit"] == 0
    time.sleep(0.3)
    s.finish(name, succeeded=True)
    assert finish(box).get("reward") == 0.75
    watches = [r for r in s.requests if r.query.get("watch") in ("true", "True")]
    assert watches and watches[0].query["fieldSelector"] == f"metadata.name={name}"
    assert not s.deleted()


def test_reward_from_the_last_log_line_when_none_posted(tmp_path, standin, redis_client):
    s, name, box = started_job(tmp_path, standin, redis_client)
    s.finish(name, succeeded=True, log='working\n{"reward": 0.4}\n')
    assert finish(box).get("reward") == 0.4


def test_succeeded_without_reward_fails_the_attempt(tmp_path, standin, redis_client):
    s, name, box = started_job(tmp_path, standin, redis_client)
    s.finish(name, succeeded=True, log="no number here\n")
    assert "posted no reward" in str(finish(box)["error"])


def test_failed_job_reports_reason_and_log(tmp_path, standin, redis_client):
    s, name, box = started_job(tmp_path, standin, redis_client)
    s.finish(name, succeeded=False, reason="DeadlineExceeded",
             message="Job was active longer than specified deadline", log="Traceback: boom\n")
    err = finish(box)["error"]
    assert "DeadlineExceeded" in str(err) and "boom" in err.stderr_tail


def test_a_pod_killed_for_memory_says_so(tmp_path, standin, redis_client):
    """With backoffLimit 0 the Job only says BackoffLimitExceeded: the attempt's error names
    what ended the pod (its container OOMKilled, exit 137), which the operator acts on."""
    s, name, box = started_job(tmp_path, standin, redis_client)
    s.pod_status[name] = {"phase": "Failed", "containerStatuses": [{
        "name": "agent", "ready": False, "restartCount": 0, "image": "agents:1.0",
        "imageID": "", "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]}
    s.finish(name, succeeded=False, message="Job has reached the specified backoff limit")
    err = finish(box)["error"]
    assert "BackoffLimitExceeded" in str(err) and "OOMKilled" in str(err), err
    assert "exit code 137" in str(err)


def test_permanent_api_error_fails_at_once_with_the_api_message(tmp_path, standin,
                                                                redis_client):
    s, server = standin
    s.create_errors = [(422, 'Job.batch "x" is invalid: spec.template.spec.containers[0]'
                             '.image: Required value')]
    ctl = controller(make_cfg(tmp_path, server), redis_client)
    err = finish(run_async(ctl, endpoint()))["error"]
    assert "422" in str(err) and "image: Required value" in str(err)
    assert len(s.created()) == 1  # not retried


def test_transient_api_errors_are_retried(tmp_path, standin, redis_client):
    standin[0].create_errors = [(503, "etcd leader changed"), (503, "etcd leader changed")]
    s, name, box = started_job(tmp_path, standin, redis_client, posted=lambda: 1.0)
    s.finish(name, succeeded=True)
    assert finish(box).get("reward") == 1.0
    assert len(s.created()) == 3


def test_transient_errors_past_the_retry_budget_fail_the_attempt(tmp_path, standin,
                                                                 redis_client):
    s, server = standin
    s.create_errors = [(503, "down")] * 3
    ctl = controller(make_cfg(tmp_path, server, "controller.kubernetes.api_retries=3"),
                     redis_client)
    err = finish(run_async(ctl, endpoint()))["error"]
    assert "503" in str(err) and len(s.created()) == 3


def test_the_api_server_away_past_the_retries_is_waited_for_not_a_failure(tmp_path, standin,
                                                                       redis_client):
    """A control-plane upgrade: reads of the Job fail past the retry budget for a while. The
    Job runs on without the API server, so the attempt waits (within its timeout) rather than
    fail and start a second Job beside it."""
    s, server = standin
    s.read_errors = 7  # more than two rounds of 3 tries
    ctl = controller(make_cfg(tmp_path, server, "controller.kubernetes.api_retries=3"),
                     redis_client)
    llm = endpoint()
    box = run_async(ctl, llm, posted=lambda: 0.5)
    name = job_name(llm.rollout_id)
    wait_for(lambda: name in s.jobs and s.read_errors == 0)
    s.finish(name, succeeded=True)
    assert finish(box).get("reward") == 0.5, box.get("error")
    assert len(s.created()) == 1


@pytest.mark.parametrize("why", ["cancel", "timeout"])
def test_cancel_and_timeout_delete_the_job_with_its_pods(tmp_path, standin, redis_client, why):
    flag = threading.Event()
    s, name, box = started_job(tmp_path, standin, redis_client, cancelled=flag.is_set,
                               timeout_s=1.5 if why == "timeout" else 60)
    if why == "cancel":
        flag.set()
    err = finish(box)["error"]
    assert ("cancelled" if why == "cancel" else "timed out") in str(err)
    assert name not in s.jobs
    (delete,) = s.deleted()
    assert delete.path.endswith(f"/jobs/{name}")
    policy = delete.query.get("propagationPolicy") or (delete.body or {}).get(
        "propagationPolicy")
    assert policy == "Background"


def test_an_error_while_waiting_deletes_the_job(tmp_path, standin, redis_client):
    """Redis away past the client's reconnect budget (the cancel check reads it), or any
    other error while the Job runs: the attempt fails, and its Job must not run on beside
    the retry's."""
    import redis

    broken = threading.Event()

    def cancelled() -> bool:
        if broken.is_set():
            raise redis.ConnectionError("Redis is away")
        return False

    box: dict = {}
    s, server = standin
    llm = endpoint()
    ctl = controller(make_cfg(tmp_path, server), redis_client)

    def target() -> None:
        try:
            ctl.run({"text": "abc"}, llm, 60, PauseAwareClock(lambda: False), cancelled)
        except Exception as exc:  # noqa: BLE001 - what the attempt raises
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    name = job_name(llm.rollout_id)
    wait_for(lambda: name in s.jobs)
    broken.set()
    thread.join(30)
    assert not thread.is_alive() and isinstance(box.get("error"), redis.ConnectionError)
    assert name not in s.jobs and len(s.deleted()) == 1


@pytest.mark.parametrize("reason, grace_s", [("InvalidImageName", 600),
                                             ("ImagePullBackOff", 2)])
def test_a_container_that_cannot_start_fails_the_attempt(tmp_path, standin, redis_client,
                                                         reason, grace_s):
    """A bad image name fails at once; a pull the kubelet retries, once it has lasted
    ``start_grace_s``: not at the 60 s timeout."""
    s, server = standin
    llm = endpoint()
    name = job_name(llm.rollout_id)
    s.pod_status[name] = {"phase": "Pending", "containerStatuses": [{
        "name": "agent", "ready": False, "restartCount": 0, "image": "agents:1.0",
        "imageID": "", "state": {"waiting": {"reason": reason, "message": "no such image"}}}]}
    start = time.monotonic()
    cfg = make_cfg(tmp_path, server, f"controller.kubernetes.start_grace_s={grace_s}")
    box = run_async(controller(cfg, redis_client), llm, timeout_s=60)
    err = finish(box)["error"]
    assert reason in str(err) and "no such image" in str(err)
    took = time.monotonic() - start
    assert took < 20 and (grace_s > 60 or took >= grace_s), took
    assert name not in s.jobs  # deleted, not left to its deadline


def test_a_job_whose_pod_cannot_be_created_fails_with_the_reason(tmp_path, standin,
                                                                  redis_client):
    """Pod Security, a quota that asks for limits, a missing service account: the Job
    controller cannot create the pod and says so only in an event. Once that has lasted
    ``start_grace_s`` the attempt fails with the event's words, not a bare timeout at 60 s
    (a quota may free up meanwhile, so not at once)."""
    s, server = standin
    llm = endpoint()
    name = job_name(llm.rollout_id)
    why = ('pods "x" is forbidden: violates PodSecurity "restricted:latest": '
           'allowPrivilegeEscalation != false')
    s.create_refused[name] = why
    start = time.monotonic()
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.start_grace_s=2")
    err = finish(run_async(controller(cfg, redis_client), llm, timeout_s=60))["error"]
    assert "FailedCreate" in str(err) and "PodSecurity" in str(err), err
    took = time.monotonic() - start
    assert 2 <= took < 30, took
    assert name not in s.jobs  # deleted


def test_a_sample_too_large_for_a_jobs_environment_is_a_clear_error(tmp_path, standin):
    _, server = standin
    cfg = make_cfg(tmp_path, server)
    with pytest.raises(AgentError, match="bytes of JSON; a Job gets it in its environment"):
        build_job(cfg.controller.kubernetes, command="true", llm=endpoint(),
                  gateway_url="http://gw", sample={"text": "x" * 200_000}, settings={},
                  run_id=RUN, group_id=GROUP, index=0, attempt=1, timeout_s=10)


def test_a_pod_still_pending_at_the_timeout_is_named(tmp_path, standin, redis_client):
    s, server = standin
    llm = endpoint()
    s.pod_status[job_name(llm.rollout_id)] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient cpu."}]}
    # the pod is first read after 3 watch windows (3 s here)
    box = run_async(controller(make_cfg(tmp_path, server), redis_client), llm, timeout_s=5)
    err = str(finish(box)["error"])
    assert "timed out" in err and "Unschedulable" in err and "Insufficient cpu" in err


def test_pauses_move_the_job_deadline_out(tmp_path, standin, redis_client):
    """The gateway is paused the whole time: the attempt's own timeout never runs, and the
    agent (9 s) outlives the Job's first deadline (2 + 4 s), which Kubernetes counts in wall
    time. The deadline is moved out as the pause goes on, and the agent finishes."""
    s, server = standin
    s.runner = "local"
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.deadline_slack_s=4",
                   f"controller.agent={sys.executable} -c 'import time; time.sleep(9); "
                   f"print(0.7)'")
    llm = endpoint()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["reward"] = controller(cfg, redis_client).run(
                {}, llm, 2.0, PauseAwareClock(lambda: True), lambda: False)
        except AgentError as exc:
            box["error"] = exc

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    assert finish(box).get("reward") == 0.7, box.get("error")
    patches = [r.body["spec"]["activeDeadlineSeconds"] for r in s.requests
               if r.method == "PATCH"]
    assert patches and patches == sorted(patches) and patches[-1] >= 9


class _PausedFor(PauseAwareClock):
    """A clock that has counted ``seconds`` of pause and no active time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(lambda: True)
        self.seconds = seconds

    def tick(self) -> None:
        self.paused = self.seconds


def test_a_job_taken_up_adds_its_pauses_to_the_deadline_it_was_left(tmp_path, standin,
                                                                     redis_client):
    """The first delivery moved the Job's deadline out by its 5 s of pause, then its worker
    died; the delivery that takes the Job up adds its own 4 s on top (30 + 4 + 5 + 4), not
    in place of the first's, or the agent would be killed within its timeout."""
    s, server = standin
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.deadline_slack_s=4")
    llm = endpoint()
    name = job_name(llm.rollout_id)
    boxes = []
    for clock, adopted, deadline in ((_PausedFor(5), False, 39), (_PausedFor(4), True, 43)):
        box: dict[str, Any] = {}

        def target(clock=clock, adopted=adopted, box=box) -> None:
            try:
                box["reward"] = controller(cfg, redis_client).run(
                    {}, llm, 30.0, clock, lambda: False, posted_reward=lambda: 0.5,
                    adopted=adopted)
            except AgentError as exc:
                box["error"] = exc

        box["thread"] = threading.Thread(target=target, daemon=True)
        box["thread"].start()
        boxes.append(box)
        wait_for(lambda d=deadline: name in s.jobs and
                 s.jobs[name]["spec"].get("activeDeadlineSeconds") == d)
    s.finish(name, succeeded=True)
    for box in boxes:
        assert finish(box).get("reward") == 0.5, box.get("error")


def test_waiting_for_a_creation_slot_is_not_the_agents_time(tmp_path, standin, redis_client):
    s, server = standin
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.creates_per_minute=20")
    first = run_async(controller(cfg, redis_client, index=1), endpoint(1), posted=lambda: 1)
    wait_for(lambda: len(s.jobs) == 1)
    # the next slot is 3 s away; the attempt's timeout is 2 s of the agent's own time
    llm = endpoint()
    box = run_async(controller(cfg, redis_client), llm, timeout_s=2, posted=lambda: 0.5)
    wait_for(lambda: job_name(llm.rollout_id) in s.jobs)
    s.finish(job_name(llm.rollout_id), succeeded=True)
    assert finish(box).get("reward") == 0.5, box.get("error")
    s.finish(job_name(endpoint(1).rollout_id), succeeded=True)
    finish(first)


def test_creations_are_paced_across_controllers(tmp_path, standin, redis_client):
    s, server = standin
    cfg = make_cfg(tmp_path, server, "controller.kubernetes.creates_per_minute=120")
    began = time.time()
    boxes = [run_async(controller(cfg, redis_client, index=i), endpoint(i), posted=lambda: 0.5)
             for i in range(4)]
    wait_for(lambda: len(s.jobs) == 4)
    for name in list(s.jobs):
        s.finish(name, succeeded=True)
    assert all(finish(b).get("reward") == 0.5 for b in boxes)
    # 120 per minute: one every 0.5 s, whoever creates, so the fourth slot comes 1.5 s after
    # the first at the earliest. Measured from the start, not gap by gap: a request that
    # reaches the stand-in late (a loaded machine) shortens the gap after it
    times = sorted(r.at for r in s.created())
    assert times[-1] - began >= 1.5 - 0.05, [t - began for t in times]


def test_redelivered_sibling_adopts_the_running_job(tmp_path, standin, redis_client):
    s, server = standin
    cfg = make_cfg(tmp_path, server)
    first = controller(cfg, redis_client)
    llm = endpoint()
    box1 = run_async(first, llm)
    name = job_name(llm.rollout_id)
    wait_for(lambda: name in s.jobs)
    # the worker "dies"; a new delivery of the same sibling task looks for its Job, whose
    # attempt is still open
    redis_client.hset(keys.rollout(llm.rollout_id), "status", "running")
    second = controller(cfg, redis_client)
    assert second.adopt() == llm.rollout_id
    assert controller(cfg, redis_client, index=1).adopt() is None  # another sibling: none
    box2 = run_async(second, LLMEndpoint(llm.base_url, "", "policy", llm.rollout_id),
                     posted=lambda: 0.9, adopted=True)
    time.sleep(0.3)
    s.finish(name, succeeded=True)
    assert finish(box2).get("reward") == 0.9
    finish(box1)
    assert len(s.created()) == 1  # no duplicate Job


@pytest.mark.parametrize("closed_as", ["failed", "finished"])
def test_a_job_whose_attempt_was_closed_is_not_adopted(tmp_path, standin, redis_client,
                                                       closed_as):
    """The dead worker had judged the Job's end (no reward: failed; or finished) and died
    before starting the next attempt or storing its result: the next delivery runs the
    sibling again and stores a result, instead of taking up the closed attempt, storing
    nothing, and leaving the group never complete."""
    import uuid

    from app.state.records import GroupRecord, RunRecord
    from workers.rollout.episode import _close_attempt, _start_attempt, run_sibling

    s, server = standin
    group = f"{RUN}-g{uuid.uuid4().hex[:6]}"
    cfg = make_cfg(tmp_path, server, "controller.max_attempts=1")
    redis_client.hset(keys.run(RUN), mapping=RunRecord(
        run_id=RUN, config=cfg.to_dict()).to_hash())
    redis_client.hset(keys.group(group), mapping=GroupRecord(
        group_id=group, run_id=RUN, sample_index=0, sample={"text": "abc"}, n=1).to_hash())
    rid, token = _start_attempt(redis_client, RUN, group, 0, 1)
    first = KubernetesController(cfg.controller.agent, {}, cfg.controller.kubernetes,
                                 client=redis_client, gateway_url="http://gw.test:8200",
                                 run_id=RUN, group_id=group, index=0)
    box = run_async(first, LLMEndpoint(f"http://gw.test:8200/rollout/{rid}/v1", token,
                                       "policy", rid))
    wait_for(lambda: job_name(rid) in s.jobs)
    s.finish(job_name(rid), succeeded=True)
    finish(box)
    assert _close_attempt(redis_client, rid, closed_as)  # then the worker died
    created = len(s.created())
    box: dict = {}
    delivery = threading.Thread(  # the next delivery
        target=lambda: box.update(result=run_sibling(redis_client, group, 0)), daemon=True)
    delivery.start()
    wait_for(lambda: len(s.created()) == created + 1)  # it runs the sibling again
    again = next(j["metadata"]["annotations"][ANNOTATION_ROLLOUT] for j in s.jobs.values()
                 if j["metadata"]["annotations"][ANNOTATION_ROLLOUT].startswith(group)
                 and j["metadata"]["annotations"][ANNOTATION_ROLLOUT] != rid)
    redis_client.hset(keys.rollout(again), "reward", "1.0")
    s.finish(job_name(again), succeeded=True)
    delivery.join(30)
    assert box["result"].status == "ok" and box["result"].rollout_id == again
    assert redis_client.hget(keys.group_results(group), "0") is not None


def test_failed_jobs_are_not_adopted(tmp_path, standin, redis_client):
    s, server = standin
    cfg = make_cfg(tmp_path, server)
    llm = endpoint()
    box = run_async(controller(cfg, redis_client), llm)
    wait_for(lambda: job_name(llm.rollout_id) in s.jobs)
    s.finish(job_name(llm.rollout_id), succeeded=False)
    finish(box)
    assert controller(cfg, redis_client).adopt() is None


def test_missing_cluster_configuration_is_a_clear_error(tmp_path, redis_client):
    cfg = load_config(None, ["controller.backend=kubernetes",
                             f"controller.kubernetes.kubeconfig={tmp_path}/nope"])
    with pytest.raises(AgentError, match="no usable cluster configuration"):
        controller(cfg, redis_client)


@pytest.mark.slow
def test_training_with_agents_as_jobs(tmp_path, redis_client, gateway_service, celery_workers):
    """The real driver, rollout worker, gateway, vLLM and trainer; every sibling is a Job the
    stand-in runs as a local process (the demo agent's program), which calls the model
    through the gateway and POSTs its reward."""
    import os

    from app.driver.loop import train
    from app.state.records import SiblingResult

    s = StandIn(runner="local")
    with Server(s) as server:
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps({"text": t, "target": t[::-1]}) + "\n"
                                for t in ("abc", "bad", "cab", "dab")))
        env = json.loads(os.environ["CARRYOVER_OVERRIDES"])
        cfg = load_config(None, [
            *env, f"data.train_files={data}", "data.train_batch_size=1",
            "agentlightning.async_rollout.async_train_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "trainer.total_steps=2",
            "controller.backend=kubernetes",
            # the "container" is a local process: this environment's Python is its image
            f"controller.agent={sys.executable} -m examples.reverse.main",
            f"controller.kubernetes.kubeconfig={server.kubeconfig(str(tmp_path / 'kc'))}",
            "controller.kubernetes.watch_timeout_s=1", "agent.tool_median_s=0",
            f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
            "logging.console=false", f"trainer.weights_dir={tmp_path / 'weights'}"])
        rows: list[dict] = []
        summary = train(cfg, on_step=lambda step, metrics: rows.append(metrics))
    assert summary["steps"] == 2, summary
    created = s.created()
    assert len(created) >= 4  # two groups of two trained, at least
    names = [r.body["metadata"]["name"] for r in created]
    assert len(names) == len(set(names))
    finished = [j for j in s.jobs.values() if j["status"].get("succeeded")]
    assert len(finished) >= 4
    # every trained rollout was a Job whose agent finished with a reward, and both of its
    # turns were captured and trained (its calls are released once its step is stored)
    results = {}
    for step in range(2):
        for gid in redis_client.lrange(keys.run_step_groups(summary["run_id"], step), 0, -1):
            for raw in redis_client.hvals(keys.group_results(gid)):
                r = SiblingResult.from_json(raw)
                results[r.rollout_id] = r
    jobs = {j["metadata"]["annotations"][ANNOTATION_ROLLOUT] for j in finished}
    assert set(results) <= jobs
    assert all(r.status == "ok" and r.reward is not None for r in results.values())
    assert all(row["batch/samples"] == 2 * row["batch/rollouts"] for row in rows)


def test_the_running_job_of_a_cancelled_group_is_deleted_on_redelivery(tmp_path, standin,
                                                                       redis_client):
    """The worker watching the Job died; its group was cancelled (past the age cap) before
    the task came back. The new delivery finds the Job, and deletes it instead of leaving it
    to run to its deadline."""

    from app.state.records import GroupRecord, RunRecord
    from workers.rollout.episode import _start_attempt, run_sibling

    s, server = standin
    cfg = make_cfg(tmp_path, server)
    rid, token = _start_attempt(redis_client, RUN, GROUP, 0, 1)
    first = run_async(controller(cfg, redis_client), LLMEndpoint(
        f"http://gw.test:8200/rollout/{rid}/v1", token, "policy", rid))
    wait_for(lambda: job_name(rid) in s.jobs)
    redis_client.hset(keys.run(RUN), mapping=RunRecord(
        run_id=RUN, config=cfg.to_dict()).to_hash())
    redis_client.hset(keys.group(GROUP), mapping=GroupRecord(
        group_id=GROUP, run_id=RUN, sample_index=0, sample={"text": "abc"},
        status="cancelled").to_hash())
    result = run_sibling(redis_client, GROUP, 0)
    assert result.status == "failed" and result.error == "group cancelled"
    assert job_name(rid) not in s.jobs and len(s.created()) == 1
    assert redis_client.hget(keys.rollout(rid), "status") == "cancelled"
    assert "deleted" in str(finish(first)["error"])  # the first watcher saw it go
