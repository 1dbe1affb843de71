"""The ``kubernetes`` controller: one Kubernetes Job per rollout attempt.

The Job runs ``controller.agent`` (a shell command) in the configured image with the
per-rollout endpoint and the task sample in its environment, exactly what the ``process``
backend gives a local process. The agent POSTs its reward to the gateway (or prints it as its
last log line). The rollout task watches the Job (with a re-read after every watch window,
so a missed event costs one window), deletes it with its pods on timeout or cancel, and
paces creations through Redis so ``creates_per_minute`` holds across every rollout worker.

Jobs carry labels for run, group, sibling index and attempt, and the exact rollout id as an
annotation: a redelivered sibling task (a worker died, a driver resumed and re-sent its
groups) adopts the Job that is already running instead of starting a second one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import redis
import tenacity

from app.config.schema import KubernetesConfig
from app.state import keys
from app.state.records import RolloutRecord
from workers.rollout.base import (
    SAMPLE_ENV_MAX_BYTES,
    AgentError,
    Controller,
    LLMEndpoint,
    PauseAwareClock,
    fits_environment,
    parse_reward,
    stop_reason,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, V1Job, V1Pod
    from kubernetes.client.exceptions import ApiException

_P = ParamSpec("_P")
_T = TypeVar("_T")

log = logging.getLogger(__name__)

MANAGED_BY = {"app.kubernetes.io/managed-by": "carryover"}
LABEL_RUN = "carryover.io/run"
LABEL_GROUP = "carryover.io/group"
LABEL_INDEX = "carryover.io/index"
LABEL_ATTEMPT = "carryover.io/attempt"
ANNOTATION_ROLLOUT = "carryover.io/rollout-id"
# Transient API answers: throttled, server trouble. Everything else 4xx is the request's fault.
TRANSIENT_STATUS = {0, 408, 429, 500, 502, 503, 504}
# A container waiting for one of these never starts: the attempt fails at once (with the
# kubelet's message) instead of at its timeout.
NEVER_STARTS = {"InvalidImageName", "ErrImageNeverPull"}
# These the kubelet retries, and a busy registry or node causes them too: the attempt fails
# once one has lasted ``start_grace_s``. A pod that is only unschedulable waits for its
# timeout: an autoscaler may add the node.
MAY_NOT_START = {"ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                 "CreateContainerError", "RunContainerError"}
# The pod is read every this many watch windows until it runs (with thousands of Jobs
# pending, a read per window would load the API server); the Job's ready count ends it early.
POD_CHECK_WINDOWS = 3

# One Redis script: reserve the next creation slot, return how long to wait for it.
_PACE = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
local slot = math.max(t, tonumber(redis.call('GET', KEYS[1]) or '0'))
redis.call('SET', KEYS[1], string.format('%.6f', slot + tonumber(ARGV[1])), 'EX', 3600)
return string.format('%.6f', slot - t)
"""


def _dns_name(text: str, prefix: str = "", limit: int = 63) -> str:
    """A DNS-1123 label (lower-case alphanumerics and '-'), unique for ``text``."""
    body = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = prefix + body
    if len(name) > limit or body != text:
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        name = name[:limit - 11].rstrip("-") + "-" + digest
    return name


def job_name(rollout_id: str) -> str:
    return _dns_name(rollout_id, prefix="co-")


def label_value(text: str) -> str:
    """A valid label value for an id (ids here are already valid; long ones are hashed)."""
    if re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]", text):
        return text
    return _dns_name(text)


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def job_labels(run_id: str, group_id: str, index: int, attempt: int | None,
               extra: dict[str, str]) -> dict[str, str]:
    labels = {**extra, **MANAGED_BY, LABEL_RUN: label_value(run_id),
              LABEL_GROUP: label_value(group_id), LABEL_INDEX: str(index)}
    if attempt is not None:
        labels[LABEL_ATTEMPT] = str(attempt)
    return labels


def build_job(kcfg: KubernetesConfig, *, command: str, llm: LLMEndpoint, gateway_url: str,
              sample: dict[str, object], settings: dict[str, object], run_id: str,
              group_id: str, index: int, attempt: int, timeout_s: float) -> V1Job:
    """The Job for one attempt, as the client's own models (which check required fields)."""
    from kubernetes import client as k8s

    sample_json = json.dumps(sample)
    if not fits_environment(sample_json):
        raise AgentError(f"the task sample is {len(sample_json)} bytes of JSON; a Job gets it "
                         f"in its environment, which takes at most {SAMPLE_ENV_MAX_BYTES} "
                         "(Linux refuses one variable over 128 KiB): shorten the sample, or "
                         "give the agent a reference to fetch")
    base = f"{gateway_url.rstrip('/')}/rollout/{llm.rollout_id}"
    env = {**_plain(kcfg.env or {}),
           "OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": llm.api_key,
           "OPENAI_MODEL": llm.model, "CARRYOVER_ROLLOUT_ID": llm.rollout_id,
           "CARRYOVER_REWARD_URL": f"{base}/reward",
           "CARRYOVER_MAX_WAIT_S": str(llm.max_wait_s),
           "CARRYOVER_SAMPLE": sample_json,
           "CARRYOVER_AGENT_SETTINGS": json.dumps(settings)}
    # names carryover sets are refused in controller.kubernetes.env when the config loads
    secrets = _secret_refs(kcfg.env or {})
    labels = job_labels(run_id, group_id, index, attempt, dict(kcfg.labels or {}))
    container = k8s.V1Container(
        name="agent", image=kcfg.image, image_pull_policy=kcfg.image_pull_policy,
        command=["/bin/sh", "-c", command],
        env=[k8s.V1EnvVar(name=k, value=str(v)) for k, v in env.items()]
        + [k8s.V1EnvVar(name=k, value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(name=ref["secret"], key=ref["key"])))
           for k, ref in secrets.items()],
        resources=k8s.V1ResourceRequirements(**_resources(kcfg.resources)))
    pod = k8s.V1PodSpec(
        restart_policy="Never", containers=[container],
        service_account_name=kcfg.service_account or None,
        # the namespace's service account token gives agent code the Kubernetes API
        automount_service_account_token=bool(kcfg.automount_service_account_token),
        node_selector=dict(kcfg.node_selector) or None)
    return k8s.V1Job(
        api_version="batch/v1", kind="Job",
        metadata=k8s.V1ObjectMeta(name=job_name(llm.rollout_id), labels=labels,
                                  annotations={ANNOTATION_ROLLOUT: llm.rollout_id}),
        spec=k8s.V1JobSpec(
            backoff_limit=0,
            active_deadline_seconds=int(math.ceil(timeout_s + float(kcfg.deadline_slack_s))),
            ttl_seconds_after_finished=int(kcfg.ttl_seconds_after_finished),
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels),
                                           spec=pod)))


def _plain(env: Mapping[str, str | Mapping[str, str]]) -> dict[str, str]:
    """``controller.kubernetes.env``'s plain values."""
    return {k: str(v) for k, v in dict(env).items() if not isinstance(v, Mapping)}


def _secret_refs(env: Mapping[str, str | Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """``controller.kubernetes.env``'s Secret keys (``{secret: name, key: key}``): the value
    is read from the Secret by the kubelet and never stands in the Job spec."""
    return {k: {"secret": str(v["secret"]), "key": str(v["key"])}
            for k, v in dict(env).items() if isinstance(v, Mapping)}


def _resources(spec: Mapping[str, Mapping[str, str | float]] | None
               ) -> dict[str, dict[str, str]]:
    """``controller.kubernetes.resources`` (its shape checked when the config loads) with
    each quantity as the string the API takes."""
    return {k: {rk: str(rv) for rk, rv in dict(v).items()} for k, v in dict(spec or {}).items()}


def outcome(job: V1Job) -> tuple[str, str] | None:
    """(``succeeded`` | ``failed``, reason) once the Job has finished, else None."""
    status = job.status
    if status is None:
        return None
    for cond in status.conditions or []:
        if cond.status == "True" and cond.type == "Failed":
            return "failed", f"{cond.reason or 'Failed'}: {cond.message or ''}".rstrip(": ")
        if cond.status == "True" and cond.type == "Complete":
            return "succeeded", ""
    if status.succeeded:
        return "succeeded", ""
    if status.failed:
        return "failed", "pod failed"
    return None


_API_LOCK = threading.Lock()
_API_CLIENTS: dict[tuple[str | None, str | None], ApiClient] = {}
# connections the shared client keeps: every rollout slot of a worker (64 by default) holds
# a watch, and the client's default (5 per CPU) dropped and reopened one per request past it
API_POOL_SIZE = 128


def api_client(kubeconfig: str | None, context: str | None) -> ApiClient:
    """One ApiClient per (kubeconfig, context) per process: in-cluster config when running
    in a pod and no kubeconfig is named, else the kubeconfig (default ~/.kube/config)."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    key = (kubeconfig, context)
    with _API_LOCK:
        if key not in _API_CLIENTS:
            conf = k8s.Configuration()
            conf.connection_pool_maxsize = API_POOL_SIZE
            if kubeconfig is None and context is None:
                try:
                    k8s_config.load_incluster_config(client_configuration=conf)
                    _API_CLIENTS[key] = k8s.ApiClient(conf)
                    return _API_CLIENTS[key]
                except k8s_config.ConfigException:
                    pass
            try:
                k8s_config.load_kube_config(config_file=kubeconfig, context=context,
                                            client_configuration=conf)
                _API_CLIENTS[key] = k8s.ApiClient(conf)
            except (k8s_config.ConfigException, OSError) as exc:
                raise AgentError(f"controller.kubernetes: no usable cluster configuration "
                                 f"(kubeconfig {kubeconfig or '~/.kube/config'}): {exc}"
                                 ) from None
        return _API_CLIENTS[key]


def _transient(exc: BaseException) -> bool:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUS
    return isinstance(exc, HTTPError | OSError)


def api_message(exc: ApiException) -> str:
    """The Status message the API server sent, else the HTTP reason."""
    try:
        body = json.loads(exc.body)
        return str(body.get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(exc, "reason", exc))


class KubernetesController(Controller):
    def __init__(self, command: str, settings: dict[str, object], kcfg: KubernetesConfig, *,
                 client: redis.Redis, gateway_url: str, run_id: str, group_id: str,
                 index: int) -> None:
        from kubernetes import client as k8s

        self.command = command
        self.settings = settings
        self.kcfg = kcfg
        self.redis = client
        self.gateway_url = kcfg.gateway_url or gateway_url
        self.run_id, self.group_id, self.index = run_id, group_id, index
        self.namespace = kcfg.namespace
        api = api_client(kcfg.kubeconfig, kcfg.context)
        self.batch = k8s.BatchV1Api(api)
        self.core = k8s.CoreV1Api(api)
        self.attempt = 0
        self.pod_state = ""          # why the watched Job's pod waits, for the timeout message
        self.pod_started = False     # its pod left Pending: no more pod reads
        self.pod_checked_at = 0.0    # monotonic time of the last pod read
        self.waiting_since: dict[str, float] = {}  # container waiting reason -> first seen
        self.can_patch = True        # False once RBAC refused a deadline patch
        self.can_list_events = True  # False once RBAC refused listing events
        self.deadline_paused = 0.0   # pause seconds the Job's deadline already covers
        self.deadline_base = 0.0     # its deadline before this delivery's pauses

    # --- API calls with retries -----------------------------------------------------------

    def _api(self, what: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        from kubernetes.client.exceptions import ApiException

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(int(self.kcfg.api_retries)),
            wait=tenacity.wait_exponential(multiplier=0.2, max=5),
            retry=tenacity.retry_if_exception(_transient), reraise=True,
            before_sleep=lambda rs: log.warning(
                "Kubernetes API: %s failed (%s); retrying", what, rs.outcome.exception()))
        try:
            return retrying(fn, *args, **kwargs)
        except ApiException as exc:
            raise _ApiError(exc.status, f"Kubernetes API refused to {what}: "
                            f"{exc.status} {api_message(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - transient errors that outlived the retries
            raise _ApiError(0, f"Kubernetes API unreachable to {what}: {exc}") from None

    def _pace(self, cancelled: Callable[[], bool]) -> None:
        """Wait for this creation's slot; slots are ``60 / creates_per_minute`` apart."""
        interval = 60.0 / float(self.kcfg.creates_per_minute)
        wait = float(self.redis.eval(_PACE, 1, keys.k8s_create_pace(), interval))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if cancelled():
                raise AgentError("rollout cancelled")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    # --- the controller interface -----------------------------------------------------------

    def adopt(self) -> str | None:
        """The rollout id of this sibling's Job that is still running or has succeeded, and
        whose attempt is still open. One whose attempt the dead worker had closed already (it
        judged the Job's end, then died before storing a result or starting the next Job)
        is not taken up: its result is not this delivery's to give, and a delivery that met
        only a closed attempt would store nothing and leave its group never complete."""
        labels = job_labels(self.run_id, self.group_id, self.index, None, {})
        try:
            jobs = self._api("list Jobs", self.batch.list_namespaced_job, self.namespace,
                             label_selector=selector(labels)).items
        except _ApiError as exc:
            raise AgentError(str(exc)) from None
        usable = [j for j in jobs if (outcome(j) or ("running",))[0] != "failed"
                  and (j.metadata.annotations or {}).get(ANNOTATION_ROLLOUT)]
        opened = [j for j in usable if self.redis.hget(
            keys.rollout(j.metadata.annotations[ANNOTATION_ROLLOUT]),
            RolloutRecord.field("status")) == "running"]
        if not opened:
            return None
        newest = max(opened, key=lambda j: int((j.metadata.labels or {}).get(LABEL_ATTEMPT, 0)))
        return newest.metadata.annotations[ANNOTATION_ROLLOUT]

    def stop(self, rollout_id: str) -> None:
        self._delete(job_name(rollout_id))

    def run(self, sample: dict[str, object], llm: LLMEndpoint, timeout_s: float,
            clock: PauseAwareClock, cancelled: Callable[[], bool],
            posted_reward: Callable[[], object] = lambda: None, adopted: bool = False) -> float:
        self.attempt += 1
        name = job_name(llm.rollout_id)
        if not adopted:
            self._pace(cancelled)
            clock.skip()  # waiting for its creation slot is not the agent's time
            job = build_job(self.kcfg, command=self.command, llm=llm,
                            gateway_url=self.gateway_url, sample=sample,
                            settings=self.settings, run_id=self.run_id,
                            group_id=self.group_id, index=self.index, attempt=self.attempt,
                            timeout_s=timeout_s)
            try:
                self._api(f"create Job {name}", self.batch.create_namespaced_job,
                          self.namespace, job)
            except _ApiError as exc:
                if exc.status != 409:  # 409: a redelivered create; the Job is ours
                    raise AgentError(str(exc)) from None
            log.info("rollout %s: created Job %s/%s", llm.rollout_id, self.namespace, name)
        else:
            log.info("rollout %s: adopted running Job %s/%s", llm.rollout_id,
                     self.namespace, name)
        try:
            result, reason = self._wait(name, timeout_s, clock, cancelled, adopted)
        except _Stop as stop:
            self._delete(name)
            raise AgentError(str(stop)) from None
        except _ApiError as exc:
            self._delete(name)  # the retried attempt must not run beside this one's Job
            raise AgentError(str(exc)) from None
        except Exception:
            # Redis away past its reconnect budget (the cancel check reads it), or any
            # other error: the attempt fails, and its Job must not run on beside the
            # retry's. A worker's shutdown (not an Exception) leaves it for adoption.
            self._delete(name)
            raise
        try:  # listed once: for its log, and for what ended it
            pods = self._pods(name)
        except _ApiError as exc:
            log.warning("no log for Job %s: %s", name, exc)
            pods = []
        logs = self._logs(name, pods)
        if result == "failed":
            ended = pod_ended(pods)
            raise AgentError(f"Job {name} failed: {reason}" + (f"; {ended}" if ended else ""),
                             logs[-2000:])
        posted = posted_reward()
        if posted is not None:
            return parse_reward(posted)
        for line in reversed(logs.splitlines()):
            if line.strip():
                try:
                    value = json.loads(line)
                except (ValueError, RecursionError):  # not JSON, or past the parser's limits
                    break
                return parse_reward(value)
        raise AgentError(f"Job {name} succeeded but the agent posted no reward to "
                         f"CARRYOVER_REWARD_URL and printed none", logs[-2000:])

    def _wait(self, name: str, timeout_s: float, clock: PauseAwareClock,
              cancelled: Callable[[], bool], adopted: bool = False) -> tuple[str, str]:
        from kubernetes import watch

        def check() -> None:
            reason = stop_reason(clock, timeout_s, cancelled)
            if reason:
                raise _Stop(reason + (f"; its pod was {self.pod_state}" if self.pod_state
                                      else ""))

        window = int(self.kcfg.watch_timeout_s)
        self.pod_state, self.pod_started, self.deadline_paused = "", False, 0.0
        # a Job taken up keeps the deadline its earlier deliveries moved out (their pauses):
        # this one's pauses go on top, not in their place
        self.deadline_base = -1.0 if adopted else timeout_s + float(self.kcfg.deadline_slack_s)
        self.pod_checked_at, self.waiting_since = time.monotonic(), {}
        while True:
            try:  # the resync: an event lost between windows is seen here
                job = self._read(name)
            except _ApiError as exc:
                if exc.status != 0 and exc.status not in TRANSIENT_STATUS:
                    raise
                # the API server away past the retries (a control-plane upgrade): the Job
                # runs on without it; waited for like a broken watch, within the timeout
                log.warning("cannot read Job %s (%s); waiting for the API server", name, exc)
                check()
                time.sleep(min(5.0, float(self.kcfg.watch_timeout_s)))
                continue
            done = outcome(job)
            if done:
                return done
            if self.deadline_base < 0:
                self.deadline_base = float(getattr(job.spec, "active_deadline_seconds", None)
                                           or timeout_s + float(self.kcfg.deadline_slack_s))
            check()
            self._watch_pod(job)
            self._extend_deadline(job, clock)
            w = watch.Watch()
            try:
                for event in w.stream(self.batch.list_namespaced_job, self.namespace,
                                      field_selector=f"metadata.name={name}",
                                      timeout_seconds=window,
                                      _request_timeout=window + 10):
                    if event["type"] == "DELETED":
                        raise _ApiError(404, f"Job {name} was deleted by someone else")
                    done = outcome(event["object"])
                    if done:
                        return done
                    check()
            except (_Stop, _ApiError):
                raise
            except Exception as exc:  # noqa: BLE001 - a broken watch: resync and watch again
                log.warning("watch of Job %s broke (%s); re-reading it", name, exc)
                time.sleep(1.0)
            finally:
                w.stop()

    def _watch_pod(self, job: V1Job) -> None:
        """Every ``POD_CHECK_WINDOWS`` windows until the Job's pod runs: fail the attempt when
        its container cannot start, and remember why it waits (the timeout's message says)."""
        status = job.status
        if self.pod_started or (status is not None and (status.ready or 0) > 0):
            self.pod_started = True
            return
        now = time.monotonic()
        every = POD_CHECK_WINDOWS * float(self.kcfg.watch_timeout_s)
        if now - self.pod_checked_at < every:
            return
        self.pod_checked_at = now
        name = job.metadata.name
        try:
            pods = self._pods(name)
        except _ApiError as exc:
            log.warning("cannot see the pod of Job %s: %s", name, exc)
            return
        if not pods:
            self._creation_refused(name, now)
        for pod in pods:
            pstatus = pod.status
            if (getattr(pstatus, "phase", None) or "Pending") != "Pending":
                self.pod_started, self.pod_state = True, ""
                return
            for cs in getattr(pstatus, "container_statuses", None) or []:
                waiting = getattr(cs.state, "waiting", None) if cs.state else None
                if waiting is None or not waiting.reason:
                    continue
                why = f"{waiting.reason}: {waiting.message or ''}".rstrip(": ")
                since = self.waiting_since.setdefault(waiting.reason, now)
                grace = float(self.kcfg.start_grace_s)
                if waiting.reason in NEVER_STARTS or (
                        waiting.reason in MAY_NOT_START and now - since >= grace):
                    raise _Stop(f"Job {name}'s container cannot start: {why}")
                self.pod_state = f"Pending ({why})"
            for cond in getattr(pstatus, "conditions", None) or []:
                if cond.type == "PodScheduled" and cond.status == "False":
                    self.pod_state = (f"Pending ({cond.reason or 'not scheduled'}: "
                                      f"{cond.message or ''})")

    def _creation_refused(self, name: str, now: float) -> None:
        """A Job with no pod: the Job controller may be refused its creation (Pod Security,
        a quota that asks for limits, a missing service account, a webhook), which only an
        event says. Failed once that has lasted ``start_grace_s`` (a quota may free up
        meanwhile), with the event's words; until then the timeout's message says it."""
        if not self.can_list_events:
            return
        try:
            events = self._api("list events", self.core.list_namespaced_event, self.namespace,
                               field_selector=f"involvedObject.kind=Job,"
                                              f"involvedObject.name={name}").items
        except _ApiError as exc:
            if exc.status == 403:  # RBAC without events: say so once
                self.can_list_events = False
                log.error("%s: grant list on events (docs/kubernetes.md) to hear why a Job's "
                          "pod is not created", exc)
            else:
                log.warning("cannot see the events of Job %s: %s", name, exc)
            return
        refused = [e for e in events if e.reason == "FailedCreate"]
        if not refused:
            return
        # the latest (a list's order is not promised)
        latest = max(refused, key=lambda e: str(e.last_timestamp or e.event_time or ""))
        why = f"FailedCreate: {latest.message or ''}".rstrip(": ")
        since = self.waiting_since.setdefault("FailedCreate", now)
        if now - since >= float(self.kcfg.start_grace_s):
            raise _Stop(f"Job {name} cannot create its pod: {why}")
        self.pod_state = f"not created ({why})"

    def _extend_deadline(self, job: V1Job, clock: PauseAwareClock) -> None:
        """Kubernetes counts the Job's deadline in wall time; the attempt's timeout leaves out
        time the gateway was paused. Move the deadline out by the pauses so far, in steps of
        a quarter of the slack (at least a second), so a long weight update never kills an
        agent that is within its timeout. A Job taken up adds this delivery's pauses to the
        deadline its earlier deliveries left."""
        slack = float(self.kcfg.deadline_slack_s)
        if not self.can_patch or clock.paused - self.deadline_paused < max(1.0, slack / 4):
            return
        deadline = int(math.ceil(self.deadline_base + clock.paused))
        name = job.metadata.name
        if deadline <= (getattr(job.spec, "active_deadline_seconds", None) or 0):
            return  # an earlier delivery of this task moved it further already
        try:
            self._api(f"extend the deadline of Job {name}", self.batch.patch_namespaced_job,
                      name, self.namespace, {"spec": {"activeDeadlineSeconds": deadline}})
            self.deadline_paused = clock.paused
            log.info("Job %s: activeDeadlineSeconds now %d (%.0f s paused)", name, deadline,
                     clock.paused)
        except _ApiError as exc:
            if exc.status == 403:  # RBAC without patch: say so once, not every window
                self.can_patch = False
                log.error("%s: grant patch on jobs (docs/kubernetes.md); until then time "
                          "paused counts against Job deadlines", exc)
            else:
                log.warning("%s; trying again next window", exc)

    def _read(self, name: str) -> V1Job:
        return self._api(f"read Job {name}", self.batch.read_namespaced_job, name,
                         self.namespace)

    def _delete(self, name: str) -> None:
        try:
            self._api(f"delete Job {name}", self.batch.delete_namespaced_job, name,
                      self.namespace, propagation_policy="Background")
            log.info("deleted Job %s/%s with its pods", self.namespace, name)
        except _ApiError as exc:
            if exc.status != 404:
                log.error("%s (the Job's activeDeadlineSeconds still ends it)", exc)

    def _pods(self, name: str) -> list[V1Pod]:
        """The pods of Job ``name`` (raises ``_ApiError``)."""
        return self._api("list pods", self.core.list_namespaced_pod, self.namespace,
                         label_selector=f"job-name={name}").items

    def _logs(self, name: str, pods: list[V1Pod]) -> str:
        """The agent container's log, best effort (for error messages and a printed reward)."""
        if not pods:
            return ""
        try:
            # raw body: the client's own decoding of a log turns bytes into "b'...'" text
            resp = self._api("read pod log", self.core.read_namespaced_pod_log,
                             pods[0].metadata.name, self.namespace, tail_lines=200,
                             _preload_content=False)
            return resp.data.decode("utf-8", "replace")
        except _ApiError as exc:
            log.warning("no log for Job %s: %s", name, exc)
            return ""


def pod_ended(pods: list[V1Pod]) -> str:
    """What ended a Job's pod (its container OOMKilled, exit code 137; the pod Evicted):
    with backoffLimit 0 the Job itself says only BackoffLimitExceeded."""
    said = []
    for pod in pods:
        status = pod.status
        if status is None:
            continue
        if status.reason:
            said.append(f"pod {status.reason}: {status.message or ''}".rstrip(": "))
        for cs in status.container_statuses or []:
            ended = getattr(cs.state, "terminated", None) if cs.state else None
            if ended is not None and (ended.reason or ended.exit_code):
                said.append(f"container {cs.name} {ended.reason or 'exited'} "
                            f"(exit code {ended.exit_code})")
    return ", ".join(said)


class _ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Stop(Exception):
    """Timeout, cancel, or a container that cannot start: the Job is deleted and the attempt
    fails."""
