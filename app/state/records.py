"""Every record stored in Redis or passed between processes, with its writer and reader.

Records are plain dataclasses serialised to JSON (lists) or to flat string hashes. Token
data (ids, log-probs) lives only in ``CapturedCall``; Celery messages carry ids and the
small ``SiblingResult``, never tensors.

Every field a hash ever holds is declared here, including those written one at a time
(``HSET``/``HINCRBY`` from Python, or inside a Lua script): code that names such a field
goes through ``Record.field("name")``, which refuses an undeclared one, and a unit test
checks the names the Lua scripts write.
"""

from __future__ import annotations

import json
import math
import numbers
import signal
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self


class _HashRecord:
    """Round-trip through a Redis hash: every field stored as a string (JSON for non-str)."""

    @classmethod
    def field(cls, name: str) -> str:
        """``name``, checked to be a declared field of this record."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if name not in names:
            raise KeyError(f"{cls.__name__} has no field {name!r} (declared: "
                           f"{', '.join(sorted(names))})")
        return name

    def to_hash(self) -> dict[str, str]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value if isinstance(value, str) else json.dumps(value)
        return out

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> Self:
        kwargs: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                continue
            raw = data[f.name]
            kwargs[f.name] = raw if f.type in ("str", str) else json.loads(raw)
        return cls(**kwargs)


SUCCESS_REWARD = 1.0  # a rollout with at least this reward counts as a success (acc)

# The largest reward magnitude accepted from an agent. The update holds rewards as float32 and
# squares them for a group's spread: past about 1e19 that is inf and every advantage NaN. 1e9
# leaves room for any score a person means and refuses a bug's 1e300 (or an int past float).
MAX_ABS_REWARD = 1e9


def checked_reward(value: object) -> float:
    """``value`` as a reward (a finite number within +-MAX_ABS_REWARD); ValueError saying
    what it is otherwise."""
    # numbers.Real: numpy's scalars too (np.float32, np.int64), which agents return
    if isinstance(value, bool) or type(value).__name__ == "bool_" \
            or not isinstance(value, numbers.Real):
        raise ValueError(f"a non-numeric reward: {value!r:.200}")
    try:
        reward = float(value)
    except OverflowError:
        raise ValueError(f"a reward too large for a float: {str(value)[:40]}...") from None
    if not math.isfinite(reward):
        raise ValueError(f"a non-finite reward: {reward}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"a reward of {reward:g}, beyond +-{MAX_ABS_REWARD:g} (MAX_ABS_REWARD)")
    return reward


@dataclass
class RolloutRecord(_HashRecord):
    """One agent execution (one sibling attempt). Writer: rollout task (created before the
    agent starts, status updated when it ends). Readers: gateway (auth, status), trainer."""

    rollout_id: str
    run_id: str
    group_id: str
    index: int
    attempt: int
    token_sha256: str            # the agent's bearer token, hashed: tokens are never stored
    status: str = "running"      # running | finished | failed | cancelled | lost (its worker died)
    created_at: float = 0.0
    # The temperature the gateway samples this rollout's calls at; None = the rollout
    # temperature the trainer models. Set for evaluation rollouts, which are never trained.
    temperature: float | None = None
    # 1: a Redis crash lost calls the gateway had captured for it (its agent saw them);
    # written by the gateway after the outage, read by the trainer, which leaves it out.
    calls_lost: int = 0
    # calls the gateway refused for the context length (prompt + max_tokens > max_model_len);
    # HINCRBY'd by the gateway, read by the rollout worker (controller.on_context_overflow)
    context_overflow: int = 0
    # the rollout worker process running the attempt (``reaper.WORKER_ID``): a later delivery
    # of its task closes the attempt only once that worker's alive key is gone
    worker: str = ""
    # a process agent's process group: its host, leader pid and the leader's start time (in
    # clock ticks since boot, /proc/<pid>/stat), so a later delivery on that host can stop an
    # agent its dead worker left running, and never a process that reused the pid
    agent_host: str = ""
    agent_pid: int = 0
    agent_started: str = ""
    # the reward a process or Kubernetes agent posted (``POST /rollout/<id>/reward``): written
    # by the gateway, read by the rollout worker when the agent ends; None = none posted
    reward: float | None = None


@dataclass
class CapturedCall:
    """One model call as the gateway saw it: one training sample per choice. Writer:
    gateway (RPUSH to keys.rollout_calls). Reader: trainer (batch building)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float | None]   # per response token; None where the engine gave none
    finish_reason: str | None
    policy_version: int
    temperature: float
    upstream: str
    started_at: float
    ended_at: float
    endpoint: str                  # chat.completions | completions
    stream: bool = False
    nonfinite_logprobs: int = 0    # count of non-finite/missing values; >0 -> sample unusable
    # A call frozen across a weight update (gateway.drain_mode keep) spans policy versions:
    # ``policy_version`` is the version at its start, ``policy_version_end`` the one at its
    # end (None: the same), and for a streamed call ``version_switches`` lists
    # [index of the first response token sampled on a version, that version] per switch.
    policy_version_end: int | None = None
    version_switches: list[list[int]] | None = None
    # The request parameter that constrained decoding (response_format, structured_outputs,
    # a required or named tool_choice), or None. vLLM masks the logits before it samples and
    # computes log-probs, so ``logprobs`` are those of the masked distribution the tokens
    # were drawn from: the importance weights against the unmasked policy stay exact.
    constrained: str | None = None
    # The prompt was sent as an earlier call's prompt and sampled tokens plus the new
    # messages rendered (gateway.token_continuity), not as the template's re-rendering.
    continued: bool = False

    @property
    def spans_update(self) -> bool:
        return self.policy_version_end is not None and self.policy_version_end != \
            self.policy_version

    def tokens_after_switch(self) -> int | None:
        """Response tokens sampled after the first version switch; None when unknown (a
        call that spans an update without being streamed)."""
        if not self.spans_update:
            return 0
        if not self.version_switches:
            return None
        return len(self.response_ids) - self.version_switches[0][0]

    def to_json(self) -> str:
        # json cannot hold inf/nan: such values are stored as null and counted. vars(), not
        # asdict(): asdict deep-copies every token list, on the gateway's hot path.
        return json.dumps(vars(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> CapturedCall:
        return cls(**json.loads(raw))

    @staticmethod
    def clean_logprobs(values: Iterable[object]) -> tuple[list[float | None], int]:
        out: list[float | None] = []
        bad = 0
        for v in values:
            if isinstance(v, (int, float)) and math.isfinite(v) and v > -9999.0:
                out.append(float(v))
            else:
                out.append(None)
                bad += 1
        return out, bad


@dataclass
class SiblingResult:
    """What a sibling task returns and stores (HSET keys.group_results). Writer: rollout
    task. Readers: chord callback, driver (metrics), trainer (reward)."""

    index: int
    rollout_id: str
    status: str                  # ok | failed
    reward: float | None
    attempts: int
    seconds: float               # agent wall time, last attempt
    paused_seconds: float = 0.0  # gateway pause time inside the attempt (not held against timeout)
    error: str | None = None
    finished_at: float = 0.0     # epoch seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> SiblingResult:
        return cls(**json.loads(raw))


@dataclass
class GroupRecord(_HashRecord):
    """A prompt group. Writer: driver at dispatch (status by driver/callback). Readers:
    rollout tasks (sample, run), chord callback, trainer."""

    group_id: str
    run_id: str
    sample_index: int
    sample: dict[str, object] = field(default_factory=dict)
    n: int = 1
    seq: int = 0                 # dispatch order within the run (oldest first selection)
    dispatch_step: int = 0       # optimizer steps done when dispatched
    dispatch_version: int = 0    # policy version when dispatched
    dispatched_at: float = 0.0
    # active | complete | selected | dropped | cancelled | filtered (equal rewards)
    status: str = "active"
    completed_at: float = 0.0
    callback_early: int = 0      # 1: the chord callback fired before every sibling stored its
                                 # result; the last sibling completes the group
    # Written by the driver after sending the group's chord (a group without ``sent`` is
    # sent again on resume): the sibling task ids (revoked on cancel, forgotten by
    # retention) and the chord callback's id.
    sent: int = 0
    task_ids: list[str] = field(default_factory=list)
    callback_id: str = ""
    selected_at: float = 0.0     # epoch seconds; written by the selection


@dataclass
class RunRecord(_HashRecord):
    """A training run. Writer: driver. Readers: every worker (config), ``--resume``."""

    run_id: str
    config: dict[str, object] = field(default_factory=dict)
    mode: str = "async"          # async | sync | eval (an evaluation: app.driver.evaluation)
    temperature: float | None = None  # eval: the sampling temperature of its rollouts
    step: int = 0                # optimizer steps completed
    cursor: int = 0              # next position in the epoch's order
    epoch: int = 0
    next_seq: int = 0
    status: str = "running"      # running | finished | failed
    created_at: float = 0.0
    # Counters, each HINCRBY'd where the event happens: dispatch (driver), a group dropped
    # at completion (completion script), cancelled for its age (carry's cancel script),
    # filtered at completion for equal rewards (algorithm.filter_groups), a prompt no longer
    # re-queued (data.max_prompt_failures; completion script), a prompt re-queued (either
    # script, where it is pushed: a quarantined prompt's later drops are not).
    n_dispatched: int = 0
    n_dropped: int = 0
    n_cancelled: int = 0
    n_filtered: int = 0
    n_quarantined: int = 0
    n_requeued: int = 0
    # finished rollouts of active groups, kept exactly by the carry and completion scripts
    # (``app.state.carry``); the unfinished ones the last selection carried over.
    finished_active: int = 0
    carry_unfinished: int = 0
    # the last selection's figures (``app.driver.collector.Selection``), so that a driver
    # resumed after selecting and before the update ended still reports them for that step
    last_selection: dict[str, object] = field(default_factory=dict)
    # optimizer steps done at the last evaluation reported (-1: none), so that a driver
    # resumed after reporting one (the final, before ``status`` became finished) does not
    # run and report it again
    evaluated_step: int = -1
    # the counters above (n_dropped ...) as the last step's metrics counted them: a resumed
    # driver counts from there, so what happened while no driver ran is in the next step's
    counted: dict[str, int] = field(default_factory=dict)


@dataclass
class OutageRecord:
    """A Redis outage one process rode out (LPUSH keys.redis_outages). Writer: any client
    made by ``app.state.connection.connect``, once Redis answers again. Reader:
    ``carryover status``."""

    role: str            # the process's role under the supervisor, else its program name
    pid: int
    down_at: float       # epoch seconds of the first failed command
    up_at: float         # epoch seconds of the first command that succeeded again
    error: str = ""      # the first error seen

    @property
    def seconds(self) -> float:
        return self.up_at - self.down_at

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> OutageRecord:
        return cls(**json.loads(raw))


@dataclass
class RoleExit(_HashRecord):
    """A role's process that exited while its stack ran (XADD keys.role_exits). Writer: the
    supervisor that started it (``app.services.exits``), as it sees the exit. Reader: the
    driver, which names the trainer's when it gives up on a step that kept killing it."""

    role: str
    host: str
    pid: int
    code: int               # its exit status as Popen gives it: -N = ended by signal N
    at: float = 0.0         # epoch seconds, the supervisor's clock
    oom: str = ""           # the kernel's "Killed process <pid>" line, "" when none
    oom_kills: int = 0      # OOM kills in the supervisor's memory cgroup while it ran (its
                            # children's too: no pid to tell them by)
    kernel_log: str = ""    # why the kernel's log could not be read; "" when it was
    kernel_log_unmatched: str = ""  # why the log, read, could not be matched to this exit
                            # (the kernel's pid for it unknown, records lost); "" when it was

    @property
    def cause(self) -> str:
        if self.code >= 0:
            return f"exit code {self.code}"
        try:
            return f"{signal.Signals(-self.code).name} (signal {-self.code})"
        except ValueError:
            return f"signal {-self.code}"

    def describe(self) -> str:
        """One clause: which process, when, what ended it and what the kernel said."""
        out = (f"{self.cause}, pid {self.pid} on {self.host} at "
               f"{time.strftime('%H:%M:%S', time.gmtime(self.at))} UTC")
        if self.oom:
            return out + f', the kernel: "{self.oom}"'
        if self.oom_kills:
            out += (f", the OOM killer ended {self.oom_kills} process(es) in its memory "
                    "cgroup meanwhile")
        elif self.kernel_log:
            out += (f", the kernel's log could not be read ({self.kernel_log}): `dmesg` as "
                    "root shows whether the OOM killer ended it")
        elif self.kernel_log_unmatched:
            out += (f", the kernel's log could not be matched to it "
                    f"({self.kernel_log_unmatched}): `dmesg` on the host shows whether the OOM "
                    "killer ended it")
        elif self.code == -signal.SIGKILL:
            out += ", no OOM kill of it in the kernel's log"
        return out
