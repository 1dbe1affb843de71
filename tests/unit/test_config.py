"""Configuration: the documented YAML blocks load as they are, defaults and derived values,
and every invalid config is refused with a specific line naming key, value and rule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from app.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
# The asynchronous-training blocks as the design document writes them.
DOC_BLOCKS = [
    """
    agentlightning:
      async_rollout:
        enabled: true
        async_train_batch_size: 64
    """,
    """
    data:
      train_batch_size: 32

    agentlightning:
      async_rollout:
        enabled: true
        async_train_batch_size: 64
    """,
    """
    algorithm:
      rollout_correction:
        rollout_is: token
        rollout_is_threshold: 2
    """,
]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("block", DOC_BLOCKS)
def test_documented_blocks_load_as_they_are(tmp_path, block):
    cfg = load_config(write(tmp_path, block))
    assert cfg.agentlightning.async_rollout.enabled is True
    assert cfg.agentlightning.async_rollout.async_train_batch_size == 64
    assert cfg.data.train_batch_size == 32
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2


def test_defaults_are_the_documented_values():
    cfg = load_config()
    assert cfg.data.train_batch_size == 32
    assert cfg.agentlightning.async_rollout.async_train_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2


def test_async_batch_defaults_to_twice_train_batch():
    cfg = load_config(None, ["data.train_batch_size=5"])
    assert cfg.agentlightning.async_rollout.async_train_batch_size == 10


def test_partial_file_is_completed_and_overrides_win(tmp_path):
    p = write(tmp_path, "data:\n  train_batch_size: 4\n")
    cfg = load_config(p, ["actor_rollout_ref.rollout.n=8", "gateway.hold=true"])
    assert cfg.data.train_batch_size == 4
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.gateway.hold is True
    assert cfg.trainer.total_steps == 100  # from the defaults


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):  # noqa: B017 - omegaconf's ReadonlyConfigError
        cfg.data.train_batch_size = 3


def test_agent_section_is_free_form(tmp_path):
    cfg = load_config(write(tmp_path, "agent:\n  anything: [1, 2]\n  nested: {a: 1}\n"))
    assert cfg.agent["nested"]["a"] == 1


INVALID = [
    # (overrides, expected fragment of the one problem line)
    (["agentlightning.async_rollout.async_train_batch_size=32"],
     "agentlightning.async_rollout.async_train_batch_size: value 32 must be strictly greater "
     "than data.train_batch_size (32)"),
    (["data.train_batch_size=0"], "data.train_batch_size: value 0 must be a positive integer"),
    (["data.train_batch_size=2.5"], "data.train_batch_size: value 2.5 must be a positive integer"),
    (["data.train_batch_size=true"],
     "data.train_batch_size: value true must be a positive integer"),
    (["actor_rollout_ref.rollout.n=1"],
     "actor_rollout_ref.rollout.n: value 1 must be >= 2 for the group-relative estimator"),
    (["actor_rollout_ref.rollout.n=-4"],
     "actor_rollout_ref.rollout.n: value -4 must be a positive integer"),
    (["algorithm.rollout_correction.rollout_is=tokens"],
     "algorithm.rollout_correction.rollout_is: value 'tokens' must be one of null, 'token', "
     "'sequence'"),
    (["algorithm.rollout_correction.rollout_is_threshold=-2"],
     "algorithm.rollout_correction.rollout_is_threshold: value -2 must be a positive number"),
    (["algorithm.rollout_correction.rollout_is_threshold=null"],
     "rollout_is_threshold: value null must be a positive number when rollout_is is 'token'"),
    (["algorithm.adv_estimator=gae"],
     "algorithm.adv_estimator: value 'gae' must be one of 'grpo', 'rloo'"),
    (["data.trian_batch_size=3"],
     "data.trian_batch_size: unknown key (command line); did you mean 'data.train_batch_size'?"),
    (["agentlightning.async_rolout.enabled=false"],
     "did you mean 'agentlightning.async_rollout.enabled'?"),
    (["gateway.port=70000"], "gateway.port: value 70000 must be a port number 1-65535"),
    (["gateway.url=localhost:8200"], "gateway.url: value 'localhost:8200' must be a URL"),
    (["inference.urls=[]"], "inference.urls: value [] must be a non-empty list of URLs"),
    (["controller.backend=docker"],
     "controller.backend: value 'docker' must be one of 'python', 'process', 'kubernetes'"),
    (["controller.agent=examples.reverse.agent"],
     "controller.agent: value 'examples.reverse.agent' must be module:function"),
    (["controller.on_failure=ignore"],
     "controller.on_failure: value 'ignore' must be one of 'requeue', 'zero_reward'"),
    (["agentlightning.async_rollout.max_carry_over_age_steps=0"],
     "agentlightning.async_rollout.max_carry_over_age_steps: value 0 must be a positive integer"),
    (["agentlightning.async_rollout.enabled=yes please"],
     "agentlightning.async_rollout.enabled: value 'yes please' must be true or false"),
    (["trainer.device=tpu"], "trainer.device: value 'tpu' must be one of 'auto', 'cpu', 'cuda'"),
    (["trainer.reload_timeout_s=60"],
     "trainer.reload_timeout_s: value 60 must be at least inference.startup_timeout_s (180)"),
    (["algorithm.rollout_correction.bypass_mode=true",
      "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "actor_rollout_ref.actor.policy_loss.loss_mode: value 'gspo' cannot be used with "
     "algorithm.rollout_correction.bypass_mode"),
    (["algorithm.rollout_correction.bypass_mode=true", "trainer.ranks=2",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: value 1 cannot be used with "
     "algorithm.rollout_correction.bypass_mode over 2 ranks"),
    # verl's token-count cut can leave a padding row alone, which hangs the step
    (["algorithm.rollout_correction.bypass_mode=true", "trainer.ranks=2",
      "actor_rollout_ref.actor.use_dynamic_bsz=true"],
     "actor_rollout_ref.actor.use_dynamic_bsz: value true cannot be used with "
     "algorithm.rollout_correction.bypass_mode over 2 ranks"),
    (["algorithm.rollout_correction.loss_type=ppo"],
     "algorithm.rollout_correction.loss_type: value 'ppo' must be one of 'ppo_clip', "
     "'reinforce'"),
    (["data=3"], "data: is a section, not a value"),
    # a LoRA rule reads a key that is itself bad: the key's own line, no traceback
    (["actor_rollout_ref.model.lora_rank=8", "trainer.keep_weight_versions=two"],
     "trainer.keep_weight_versions: value 'two' must be a positive integer"),
    # the gateway fills in this max_tokens: no prompt would fit beside it
    (["actor_rollout_ref.rollout.max_tokens=512"],
     "actor_rollout_ref.rollout.max_tokens: value 512 must be below inference.max_model_len "
     "(512)"),
    (["gateway.port=8100", "gateway.url=http://127.0.0.1:8100"],
     "gateway.port: value 8100 is also inference.port"),
    (["services.flower_port=6390"], "services.flower_port: value 6390 is also redis.port"),
    (["inference.device=cuda", "inference.sleep_mode=true",
      "trainer.pause_during_update=false"],
     "inference.sleep_mode: value true needs updates that pause the gateway"),
    (["controller.kubernetes.deadline_slack_s=8", "controller.kubernetes.watch_timeout_s=5"],
     "controller.kubernetes.deadline_slack_s: value 8 must be at least twice"),
    (["controller.kubernetes.start_grace_s=-1"], "controller.kubernetes.start_grace_s"),
    # deleted at once, the finished pod's log (a printed reward) would be gone
    (["controller.kubernetes.ttl_seconds_after_finished=0"],
     "controller.kubernetes.ttl_seconds_after_finished: value 0 must be an integer >= 60"),
    (["trainer.launcher=local", "trainer.nnodes=2"],
     "trainer.nnodes: value 2 needs verl's Ray worker group, and trainer.launcher is local"),
    (["redis.url=http://127.0.0.1:6390"],
     "redis.url: value 'http://127.0.0.1:6390' must be a URL like redis://host:port"),
    (["data.train_batch_size"], "data.train_batch_size: override must look like a.b.c=value"),
]


@pytest.mark.parametrize("overrides,expected", INVALID, ids=[i[1][:40] for i in INVALID])
def test_invalid_config_gives_its_own_message(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert len(info.value.problems) == 1, info.value.problems
    assert expected in info.value.problems[0]


@pytest.mark.parametrize("section", ["agent", "controller.kubernetes.env",
                                     "controller.kubernetes.labels"])
def test_a_list_where_a_mapping_goes_is_named(tmp_path, section):
    """Kubernetes writes a pod's env as a list of {name, value}; here it is a mapping."""
    *parents, leaf = section.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents))
    text += f"{'  ' * len(parents)}{leaf}:\n{'  ' * len(parents)}  - {{name: FOO, value: '1'}}\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.problems == [f"{section}: must be a mapping (name: value), not a list "
                                   f"({tmp_path / 'c.yaml'})"]


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.train_batch_size=0", "gateway.port=0", "nope=1"])
    text = str(info.value)
    assert "nope: unknown key" in text
    # unknown keys stop before value checks; fix them first, then values are checked together
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.train_batch_size=0", "gateway.port=0"])
    assert len(info.value.problems) == 2


def test_sync_mode_allows_equal_batch_sizes():
    cfg = load_config(None, ["agentlightning.async_rollout.enabled=false",
                             "agentlightning.async_rollout.async_train_batch_size=32"])
    assert cfg.agentlightning.async_rollout.enabled is False


def test_malformed_yaml_file(tmp_path):
    p = write(tmp_path, "data:\n  train_batch_size: [1,\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert "not valid YAML" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert "cannot read file" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "- a\n- b\n"))
    assert "top level must be a mapping" in info.value.problems[0]


def test_every_shipped_config_loads():
    shipped = sorted((REPO / "config").rglob("*.yaml"))
    assert len(shipped) >= 5  # default, demo, k8s example, the two GPU examples
    for path in shipped:
        load_config(path)


@pytest.mark.parametrize("name", ["qwen2.5-7b-8gpu", "qwen2.5-0.5b-1gpu"])
def test_gpu_examples_pass_config_show(name, tmp_path):
    path = REPO / "config" / "examples" / f"{name}.yaml"
    out = run_cli("config", "show", "--config", str(path))
    assert out.returncode == 0, out.stderr
    assert "device: cuda" in out.stdout and "param_dtype: bfloat16" in out.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(path.read_text().replace("gpu_memory_utilization: 0.",
                                               "gpu_memory_utilization: 1."))
    bad = run_cli("config", "show", "--config", str(broken))
    assert bad.returncode == 2
    assert "inference.gpu_memory_utilization: value 1." in bad.stderr


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_config_show_cli(tmp_path):
    p = write(tmp_path, DOC_BLOCKS[2])
    ok = run_cli("config", "show", "--config", str(p), "data.train_batch_size=8")
    assert ok.returncode == 0, ok.stderr
    shown = yaml.safe_load(ok.stdout)
    assert shown["data"]["train_batch_size"] == 8
    assert shown["agentlightning"]["async_rollout"]["async_train_batch_size"] == 16
    assert "effective agentlightning.async_rollout.async_train_batch_size = 16" in ok.stderr

    bad = run_cli("config", "show", "data.train_batch_size=0", "gateway.port=x")
    assert bad.returncode == 2
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("config error:")]
    assert len(lines) == 2
    assert bad.stdout == ""


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # YAML 1.1 would read 1e-3 as a string; verl users write learning rates that way
    cfg = load_config(write(tmp_path, "actor_rollout_ref:\n  actor:\n    lr: 2e-4\n"),
                      ["actor_rollout_ref.actor.kl_loss_coef=1e-3"])
    assert cfg.actor_rollout_ref.actor.lr == 2e-4
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 1e-3


def test_demo_steps_zero_is_checked_not_dropped():
    import argparse

    from app.demo import _overrides

    out = _overrides(argparse.Namespace(overrides=[], steps=0), sync=False)
    assert "trainer.total_steps=0" in out  # refused by validation, not a full-length demo
    with pytest.raises(ConfigError, match="trainer.total_steps: value 0"):
        load_config(None, out)


def test_rules_between_keys_report_in_a_fixed_order():
    # one config breaking rules of every group between keys at once (validate.CROSS_RULES):
    # the problems come out group by group in that order, each group's in its own order
    overrides = [
        "data.train_batch_size=32", "agentlightning.async_rollout.async_train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "inference.chat_template=no/such.jinja",
        "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=null",
        "controller.agent=not_a_reference", "inference.device=cpu", "inference.sleep_mode=true",
        "trainer.launcher=local", "trainer.nnodes=2", "gateway.drain_mode=keep",
        "trainer.test_freq=5", "data.val_files=null",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0", "controller.retry_max_wait_s=1",
        "inference.host=0.0.0.0", "inference.weight_sync=transfer",
        "inference.transfer_engine=ipc", "actor_rollout_ref.model.lora_rank=8",
        "inference.max_model_len=512", "actor_rollout_ref.rollout.max_tokens=512",
        "gateway.port=18111", "inference.port=18111",
        "controller.kubernetes.deadline_slack_s=1", "trainer.reload_timeout_s=1",
    ]
    expected = [
        "agentlightning.async_rollout.async_train_batch_size: value 32 must be strictly",
        "actor_rollout_ref.actor.ppo_mini_batch_size: value 64 is more than",
        "inference.chat_template: no file 'no/such.jinja'",
        "actor_rollout_ref.rollout.n: value 1 must be >= 2",
        "algorithm.rollout_correction.rollout_is_threshold: value null must be",
        "controller.agent: value 'not_a_reference' must be module:function",
        "inference.sleep_mode: value true is refused by vLLM on CPU",
        "trainer.nnodes: value 2 needs verl's Ray worker group",
        "gateway.drain_mode: value 'keep' cannot work with inference.sleep_mode",
        "trainer.test_freq: value 5 needs data.val_files",
        "actor_rollout_ref.rollout.val_kwargs.temperature: value 0 cannot sample",
        "controller.retry_max_wait_s: value 1 must be at least",
        "inference.host: value '0.0.0.0' opens the inference server",
        "inference.weight_sync: value 'transfer' needs the trainer's rank 0",
        "inference.transfer_engine: value 'ipc' hands GPU memory over",
        "inference.weight_sync: value 'transfer' sends whole weights",
        "gateway.drain_mode: value 'keep' cannot work with a LoRA adapter",
        "actor_rollout_ref.rollout.max_tokens: value 512 must be below",
        "gateway.port: value 18111 is also inference.port",
        "controller.kubernetes.deadline_slack_s: value 1 must be at least twice",
        "trainer.reload_timeout_s: value 1 must be at least",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected, strict=True):
        assert problem.startswith(start), (problem, start)
