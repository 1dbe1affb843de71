"""Every Redis key the project uses, in one place.

No other module builds a key string. Each function says who writes the key and who reads
it, and its type. All keys share the ``co:`` prefix so one Redis can be inspected (or
flushed in tests) by pattern.
"""

from __future__ import annotations

PREFIX = "co:"


# --- gateway: pause, leases, captures --------------------------------------------------

def paused() -> str:
    """STRING pause token; set with an expiry by the trainer (pause/resume), read by the
    gateway's admission script. Its TTL is a watchdog: a trainer that dies mid-update
    cannot leave the gateway paused for longer than the TTL."""
    return PREFIX + "gw:paused"


def leases() -> str:
    """ZSET lease id -> expiry (ms since epoch). Written by the gateway's admission script
    and its lease refresher; read by drain(). Expired members are dead requests."""
    return PREFIX + "gw:leases"


def cancelled() -> str:
    """SET lease ids that drain() gave up on; the gateway aborts those requests."""
    return PREFIX + "gw:cancelled"


def pause_history() -> str:
    """LIST recent pause durations in integer milliseconds (newest first, capped), pushed by
    the resume script; the gateway uses them for Retry-After."""
    return PREFIX + "gw:pause_history"


def pause_carries_on() -> str:
    """STRING the pause token, while that pause's drain ends the calls in the engines and the
    gateway carries them on after it (``gateway.drain_mode: continue``); set by the trainer
    with the pause's expiry, extended and deleted with the pause, read by the gateway when an
    answer comes back cut (``finish_reason: abort``)."""
    return PREFIX + "gw:pause_carries_on"


def pause_started() -> str:
    """STRING Redis server time in integer epoch milliseconds when the current pause began
    (for the remaining-pause estimate)."""
    return PREFIX + "gw:pause_started"


def policy_version() -> str:
    """STRING int: version of the weights the inference servers hold. Bumped by the trainer
    after a verified reload; recorded by the gateway on every captured call."""
    return PREFIX + "policy:version"


def rollout(rollout_id: str) -> str:
    """HASH of a rollout (see records.RolloutRecord). Created by the rollout task before the
    agent starts; read by the gateway to authenticate and by the trainer."""
    return PREFIX + "rollout:" + rollout_id


def rollout_turns(rollout_id: str) -> str:
    """HASH conversation digest -> "<position in rollout_calls>:<tag of its response>": the
    call whose prompt and response tokens a later turn of that conversation continues from
    (``gateway/continuity.py``); written with the call (``RECORD_RELEASE``)."""
    return PREFIX + "rollout:" + rollout_id + ":turns"


def rollout_calls(rollout_id: str) -> str:
    """LIST of JSON CapturedCall, appended by the gateway per model call; read by the trainer."""
    return PREFIX + "rollout:" + rollout_id + ":calls"


def rollout_leases(rollout_id: str) -> str:
    """ZSET lease id -> expiry (ms, Redis clock): the rollout's requests now in the gateway,
    as in :func:`leases` (per-rollout concurrency cap). Counted live: a lease its gateway
    never released drops out when it expires."""
    return PREFIX + "rollout:" + rollout_id + ":leases"


# --- runs, groups: the collector --------------------------------------------------------

def run(run_id: str) -> str:
    """HASH of a run (see records.RunRecord). Written by the driver; read by every worker."""
    return PREFIX + "run:" + run_id


def run_active(run_id: str) -> str:
    """ZSET group id -> dispatch sequence number: groups dispatched and not yet selected
    or dropped. Written by the driver."""
    return PREFIX + "run:" + run_id + ":active"


def run_ready(run_id: str) -> str:
    """ZSET group id -> dispatch sequence number: groups whose every sibling finished.
    Added to (once, guarded by group_done) by the chord callback; moved out by the driver."""
    return PREFIX + "run:" + run_id + ":ready"


def run_wakeup(run_id: str) -> str:
    """LIST the driver blocks on (BLPOP); the chord callback pushes one item per completion.
    Only a doorbell: the truth is run_ready."""
    return PREFIX + "run:" + run_id + ":wakeup"


def run_requeue(run_id: str) -> str:
    """LIST of dataset indices to dispatch again before taking new prompts (dropped groups)."""
    return PREFIX + "run:" + run_id + ":requeue"


def run_prompt_failures(run_id: str) -> str:
    """HASH dataset index -> how many of the prompt's groups were dropped (a sibling failed
    under ``controller.on_failure: requeue``); HINCRBY'd by the completion script, which
    stops re-queuing a prompt at ``data.max_prompt_failures``."""
    return PREFIX + "run:" + run_id + ":prompt_failures"


def run_quarantined(run_id: str) -> str:
    """HASH dataset index -> the last error of a prompt no longer dispatched (its groups
    were dropped ``data.max_prompt_failures`` times). Written (HSETNX) by the completion
    script; read by the driver, which skips these prompts."""
    return PREFIX + "run:" + run_id + ":quarantined"


def run_step_groups(run_id: str, step: int) -> str:
    """LIST of group ids selected for optimizer step ``step``; written once by the driver
    in the same transaction that removes them from run_ready; read by the trainer."""
    return PREFIX + "run:" + run_id + ":step:" + str(step)


def run_metrics(run_id: str) -> str:
    """LIST of JSON step metrics, appended by the driver (the resumable copy of the JSONL)."""
    return PREFIX + "run:" + run_id + ":metrics"


def run_driver(run_id: str) -> str:
    """STRING the id of the driver process driving the run, with a short TTL it refreshes
    (``app.driver.lease``): a second driver of the same run (a ``--resume`` while the first
    still runs) is refused instead of selecting the same groups."""
    return PREFIX + "run:" + run_id + ":driver"


def group(group_id: str) -> str:
    """HASH of a prompt group (see records.GroupRecord). Written by the driver at dispatch."""
    return PREFIX + "group:" + group_id


def group_results(group_id: str) -> str:
    """HASH sibling index -> JSON SiblingResult; HSET by the sibling task (idempotent: a
    redelivered sibling overwrites its own field)."""
    return PREFIX + "group:" + group_id + ":results"


def group_rollouts(group_id: str) -> str:
    """LIST of every rollout id started for the group (each attempt of each sibling), pushed
    by the sibling task; read when the group's captured data is released."""
    return PREFIX + "group:" + group_id + ":rollouts"


def group_done(group_id: str) -> str:
    """STRING set with SET NX by the chord callback: the one-time completion guard."""
    return PREFIX + "group:" + group_id + ":done"


def group_trained(group_id: str) -> str:
    """STRING set with SET NX by the trainer: a group is used by at most one update."""
    return PREFIX + "group:" + group_id + ":trained"


def run_step_result(run_id: str, step: int) -> str:
    """STRING JSON trainer metrics of a finished update; the trainer's idempotency guard
    (a redelivered train_step returns it instead of training again)."""
    return PREFIX + "run:" + run_id + ":step:" + str(step) + ":result"


def trainer_heartbeat(run_id: str, task: str) -> str:
    """STRING the trainer worker id, with a short TTL refreshed while a trainer task
    (``task``: ``init``, ``restore`` or a step number) runs. Read by the driver: a key that
    was seen and expired without a result means the trainer worker died, and the task is
    sent again."""
    return PREFIX + "run:" + run_id + ":trainer:" + task


# --- inference servers: which weights they hold ------------------------------------------

def policy_published() -> str:
    """HASH of the weights the inference servers should hold: ``version``, ``path`` (the
    weight directory), ``model`` (the served model name they are weights of), ``probe``
    (JSON list of the trainer's probe log-probs) and ``probe_ids``. Written by the trainer
    after every verified publish; read by its upstream keeper to reload a restarted server
    (only one serving the same model)."""
    return PREFIX + "policy:published"


def upstreams_stale() -> str:
    """SET inference URLs that went down and must not serve rollouts until the current
    weights are loaded into them again. Added to by the gateway (a connection to it failed)
    and by the trainer's upstream keeper (its health check failed); removed from by the
    keeper after a verified reload. The gateway routes around its members."""
    return PREFIX + "upstreams:stale"


def upstreams_need_weights() -> str:
    """STRING why: a stale server is back but the upstream keeper cannot give it the
    published weights, which only a trainer holds (``weight_sync: transfer`` in a trainer
    worker that restarted too) or whose export is gone (a reboot wiped ``/dev/shm``). Set
    by the keeper; read by the driver while it waits, which then sends the trainer task
    ``restore_servers`` (again after a failure); deleted by the next verified publish (that
    task's, or a step's), after which the keeper can restore a server by itself again."""
    return PREFIX + "upstreams:need_weights"


# --- rollout workers: finding the deliveries of a dead one --------------------------------

def rollout_workers() -> str:
    """SET ids of rollout and groups worker processes (one id per process start). Added at
    start; removed by the reaper once that worker's deliveries are restored."""
    return PREFIX + "workers:rollout"


def worker_alive(worker_id: str) -> str:
    """STRING with a short TTL, refreshed by the worker's heartbeat thread. Its absence
    means the worker process is dead."""
    return PREFIX + "worker:" + worker_id + ":alive"


def worker_deliveries(worker_id: str) -> str:
    """HASH broker delivery tag -> task id of every message the worker received
    (kept until the message is acknowledged). The reaper requeues the unacknowledged ones
    of a dead worker."""
    return PREFIX + "worker:" + worker_id + ":deliveries"


def reaper_lock() -> str:
    """STRING (SET NX PX): one reaper pass at a time across all rollout workers."""
    return PREFIX + "workers:reaper_lock"


# --- controllers -----------------------------------------------------------------------

def k8s_create_pace() -> str:
    """STRING float: the earliest Redis-clock time the next Kubernetes Job may be created.
    Advanced atomically by every rollout worker (``workers.rollout.kubernetes``), so the
    ``creates_per_minute`` limit holds across hosts."""
    return PREFIX + "k8s:create_pace"


def role_restarts() -> str:
    """HASH ``role_restarts_field(role, supervisor)`` -> the times that supervisor
    (``carryover up``, ``make demo``) started the role again after it exited, as a total:
    a write repeated after a lost reply counts once. ``carryover status`` sums each role's
    fields."""
    return PREFIX + "services:restarts"


def role_restarts_field(role: str, supervisor: str) -> str:
    """A field of ``role_restarts``: ``<role>@<supervisor>`` (host, pid and a random tag)."""
    return f"{role}@{supervisor}"


def role_of_restarts_field(field: str) -> str:
    return field.split("@", 1)[0]


def role_exits() -> str:
    """STREAM of RoleExit (its fields), one entry per exit of a role's process the
    supervisor saw (capped); the entry ids are Redis's clock. Read by the driver, which
    names the trainer's exits since it sent a step it gives up on."""
    return PREFIX + "services:exits"


def redis_outages() -> str:
    """LIST of JSON OutageRecord, newest first (capped): each process that lost its Redis
    connection and got it back pushes one once Redis answers; read by ``carryover status``."""
    return PREFIX + "services:redis_outages"
