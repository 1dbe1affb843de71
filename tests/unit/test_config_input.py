"""Input that YAML, OmegaConf or argparse would take in a way the user did not mean is
refused with a line naming the key: a dotted key or a key given twice in a file, a ${...}
that does not resolve, YAML 1.1's readings of 0100 and off on the command line, settings
that contradict each other, and a model or agent that is not there."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.config.loader import model_dir
from app.driver.preflight import check_agent
from app.services.commands import command_for

REPO = Path(__file__).resolve().parents[2]


def problems(path=None, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("text,key,nested", [
    ("agentlightning.async_rollout.enabled: false\n",
     "agentlightning.async_rollout.enabled", "agentlightning: {async_rollout: {enabled: ...}}"),
    ("actor_rollout_ref:\n  actor.lr: 1.0e-2\n", "actor_rollout_ref.actor.lr",
     "actor: {lr: ...}"),
])
def test_a_dotted_key_in_a_file_is_refused_not_ignored(tmp_path, text, key, nested):
    (line,) = problems(write(tmp_path, text))
    assert line.startswith(f"{key}: a dotted key is not split in a file") and nested in line


def test_a_dotted_key_inside_the_free_form_agent_section_is_the_agents_own(tmp_path):
    cfg = load_config(write(tmp_path, "agent:\n  tool.delay: 2\n"))
    assert cfg.agent["tool.delay"] == 2


def test_a_key_given_twice_in_a_file_is_refused(tmp_path):
    text = "data:\n  train_batch_size: 4\ntrainer:\n  total_steps: 5\ndata:\n  shuffle: false\n"
    (line,) = problems(write(tmp_path, text))
    assert "line 5" in line and "key 'data' given twice (first on line 1)" in line
    # a YAML merge key that the mapping then overrides is not a duplicate
    merged = "trainer:\n  <<: {total_steps: 5}\n  total_steps: 7\n"
    assert load_config(write(tmp_path, merged)).trainer.total_steps == 7


def test_an_unresolvable_interpolation_names_its_key():
    (line,) = problems(None, ["agent.prompt=Say ${name}"])
    assert line.startswith("agent.prompt: Interpolation key 'name' not found")
    assert "write \\${ for a literal ${" in line
    (line,) = problems(None, ["data.train_files=${oc.env:CARRYOVER_NO_SUCH_VAR}"])
    assert line.startswith("data.train_files:") and "CARRYOVER_NO_SUCH_VAR" in line


def test_an_escaped_interpolation_stays_text_through_a_stored_run():
    cfg = load_config(None, [r"agent.prompt=Say \${name}"])
    assert cfg.agent["prompt"] == "Say ${name}"
    # a run's config is stored resolved, and every worker loads it back from there
    stored = cfg.to_dict()
    assert load_config(base=stored).agent["prompt"] == "Say ${name}"
    # an interpolation that resolves still does, as verl's configs use them
    cfg = load_config(None, ["agent.name=${inference.served_model_name}"])
    assert cfg.agent["name"] == cfg.inference.served_model_name


@pytest.mark.parametrize("raw,value", [
    ("0100", "0100"), ("1:30", "1:30"), ("off", "off"), ("yes", "yes"),
    ("2024-01-01", "2024-01-01"), ("0x10", "0x10"),
    ("true", True), ("False", False), ("100", 100), ("-5", -5), ("1_000", 1000),
    ("1e-3", 1e-3), ("0.5", 0.5), ("null", None), ("[1, 2]", [1, 2]),
    (".5", 0.5), ("-.5", -0.5), ("+.25e1", 2.5),
])
def test_command_line_values_read_as_verls_overrides_read_them(raw, value):
    got = load_config(None, [f"agent.v={raw}"]).select("agent")["v"]
    assert got == value and type(got) is type(value)


def test_yaml_1_1_numbers_on_the_command_line_are_not_silently_converted():
    (line,) = problems(None, ["trainer.total_steps=0100"])
    assert line == "trainer.total_steps: value '0100' must be a positive integer"
    assert load_config(None, ["redis.password=0123"]).redis.password == "0123"
    (line,) = problems(None, ["redis.password=123"])
    assert "must be a non-empty string (quote it" in line


def test_a_mini_batch_larger_than_the_batch_is_refused_as_verl_refuses_it():
    (line,) = problems(None, ["data.train_batch_size=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert line.startswith("actor_rollout_ref.actor.ppo_mini_batch_size: value 8 is more than "
                           "data.train_batch_size (4)")
    # one that does not divide it trains a smaller last mini-batch, as verl's split does
    for mini in (2, 3, 4):
        load_config(None, ["data.train_batch_size=4",
                           f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}"])


@pytest.mark.parametrize("overrides,role,message", [
    (["inference.port=8101"], "inference",
     "inference.port: value 8101 is the port of no entry of inference.urls on this host"),
    (["gateway.port=8201"], "gateway", "gateway.port: value 8201 is not the port of gateway.url"),
])
def test_a_server_started_where_its_url_does_not_reach_is_refused(overrides, role, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message):
        command_for(cfg, role)


def test_a_server_reached_through_another_hosts_url_may_bind_any_port():
    cfg = load_config(None, ["inference.urls=[http://10.0.0.5:80]", "inference.port=8101",
                             "gateway.url=http://gateway.internal", "gateway.port=8201"])
    assert "8101" in command_for(cfg, "inference").argv
    command_for(cfg, "gateway")
    # a TLS proxy on this host in front of the gateway
    command_for(load_config(None, ["gateway.url=https://localhost:8443"]), "gateway")


@pytest.mark.parametrize("path,what", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "no directory"), ("config", "no config.json in")])
def test_a_model_path_that_holds_no_model_is_a_config_error(path, what):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}"])
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.model.path: {what} ") as info:
        model_dir(cfg)
    assert "models are not downloaded" in str(info.value)
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path"):
        command_for(cfg, "inference")


@pytest.mark.parametrize("agent,message", [
    ("nosuch.mod:run", "no module 'nosuch'"),
    ("examples.reverse.nosuch:run", "no module 'examples.reverse.nosuch'"),
    ("examples.reverse.agent:nosuch", "module 'examples.reverse.agent' has no 'nosuch'"),
    ("examples.reverse.agent:math", "is a module, not a function"),
])
def test_an_agent_that_cannot_be_called_is_a_config_error(agent, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_agent(load_config(None, [f"controller.agent={agent}"]))
    assert str(info.value).startswith(f"controller.agent: value {agent!r}")


def test_an_agent_found_where_the_workers_look_passes(tmp_path, monkeypatch, caplog):
    from app.driver import preflight

    check_agent(load_config(None, ["controller.agent=examples.reverse.agent:run"]))
    # a module in the repository (where the workers run, which Celery puts on their path),
    # found whatever this process's path and working directory are
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "carryover_test_repo_agent.py").write_text("def run(sample, llm):\n    return 1\n")
    monkeypatch.setattr(preflight, "REPO_ROOT", repo)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    check_agent(load_config(None, ["controller.agent=carryover_test_repo_agent:run"]))
    assert str(repo) not in sys.path  # the path is put back
    # a module that exists but cannot be imported here (a package or a variable only the
    # workers have) is let through with a warning
    (repo / "carryover_test_needs_pkg.py").write_text("import carryover_no_such_pkg\n")
    (repo / "carryover_test_needs_env.py").write_text(
        "import os\nKEY = os.environ['CARRYOVER_TEST_WORKER_ONLY']\n")
    for name in ("carryover_test_needs_pkg", "carryover_test_needs_env"):
        check_agent(load_config(None, [f"controller.agent={name}:run"]))
    assert "carryover_no_such_pkg" in caplog.text and "KeyError" in caplog.text


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_overrides_may_follow_the_options():
    shown = run_cli("config", "show", "data.train_batch_size=4", "--config",
                    "config/demo.yaml", "trainer.total_steps=5")
    assert shown.returncode == 0, shown.stderr
    assert "train_batch_size: 4" in shown.stdout and "total_steps: 5" in shown.stdout
    stray = run_cli("config", "show", "--config", "config/demo.yaml", "a.b=1", "--bogus")
    assert stray.returncode == 2 and "unrecognized arguments: --bogus" in stray.stderr


def test_omegaconfs_missing_marker_is_not_a_value(tmp_path):
    (line,) = problems(None, ["trainer.total_steps=???"])
    assert line.startswith("trainer.total_steps: value ??? is OmegaConf's 'missing' marker")
    (line,) = problems(write(tmp_path, "trainer:\n  total_steps: ???\n"))
    assert line.startswith("trainer.total_steps: value ???")


def test_the_environments_config_is_named_as_it_was_given(monkeypatch, tmp_path):
    from app.config.loader import env_overrides, service_config

    monkeypatch.setenv("CARRYOVER_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"^\$CARRYOVER_CONFIG .*nope.yaml: cannot read file"):
        service_config()
    monkeypatch.setenv("CARRYOVER_OVERRIDES", '[["data.train_batch_size=4"]]')
    with pytest.raises(ConfigError, match=r"^\$CARRYOVER_OVERRIDES: value .* must be a JSON "
                                          "list of a.b.c=value strings"):
        env_overrides()


def test_an_unknown_device_is_refused_not_taken_for_auto(monkeypatch):
    from app.services import device

    monkeypatch.setenv("CARRYOVER_DEVICE", "gpu")
    device.host_device.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"\$CARRYOVER_DEVICE: value 'gpu' must be cpu, "
                                              "cuda or auto"):
            device.host_device()
    finally:
        device.host_device.cache_clear()


@pytest.mark.parametrize("flags,override,flag", [
    ({"steps": 5}, "trainer.total_steps=50", "--steps"),
    ({"sync": True}, "agentlightning.async_rollout.enabled=true", "--sync"),
])
def test_a_demo_flag_and_the_override_it_sets_are_not_both_taken(flags, override, flag):
    import argparse

    from app.demo import _overrides

    args = argparse.Namespace(overrides=[override], steps=None, sync=False, compare=False)
    for name, value in flags.items():
        setattr(args, name, value)
    with pytest.raises(ConfigError, match=f"{flag} and {override.partition('=')[0]}"):
        _overrides(args, sync=bool(flags.get("sync")))


def test_a_date_stays_text_and_binary_or_non_utf8_files_are_one_line(tmp_path):
    """A date anywhere (a file, a flow value on the command line) went to OmegaConf, which
    refuses it with a traceback; bytes crashed later, writing the run's config as JSON."""
    cfg = load_config(write(tmp_path, "agent:\n  start: 2024-01-01\n"), ["agent.x={d: 2024-01-02}"])
    assert cfg.agent["start"] == "2024-01-01" and cfg.agent["x"]["d"] == "2024-01-02"
    assert "2024-01-01" in problems(overrides=["inference.urls=[2024-01-01]"])[0]
    (binary := tmp_path / "b.yaml").write_text("agent:\n  y: !!binary aGVsbG8=\n")
    assert problems(binary) == [f"--config {binary}: line 2: not valid YAML (!!binary values "
                                "are not supported)"]
    (latin := tmp_path / "l.yaml").write_bytes(b"agent:\n  name: \xe9t\xe9\n")
    assert problems(latin) == [f"--config {latin}: line 2: not UTF-8 text"]


@pytest.mark.parametrize("urls, says", [
    ("[http://127.0.0.1:8100/v1]", "without /v1"),
    ("[redis://127.0.0.1:6379]", "must be a URL like http://host:port"),
    ("['http://[::1:8100']", "Invalid IPv6 URL"),
    ("[http://127.0.0.1:abc]", "could not be cast"),
    ("[http://127.0.0.1:99999]", "out of range"),
])
def test_a_server_url_the_routes_cannot_be_added_to_is_refused(urls, says):
    (line,) = problems(overrides=[f"inference.urls={urls}"])
    assert line.startswith("inference.urls: ") and says in line, line


def test_one_and_blank_are_not_true_and_a_name():
    """``one_of`` compared with ==, so 1 passed as true (and then missed the rules that
    test ``is True``); a string of spaces passed as a name."""
    assert problems(overrides=["inference.sleep_mode=1"]) == [
        "inference.sleep_mode: value 1 must be one of 'auto', true, false"]
    assert problems(overrides=["controller.kubernetes.namespace=' '"])[0].startswith(
        "controller.kubernetes.namespace: value ' ' must be a non-empty string")


@pytest.mark.parametrize("override, says", [
    ("inference.gpu_memory_utilization=0", "above 0, at most 1"),
    ("inference.transfer_bucket_mb=1e-9", ">= 0.001"),  # a bucket of 0 bytes as an int
    ("gateway.lease_ttl_s=1e-300", ">= 1"),            # leases of 0 ms
])
def test_degenerate_sizes_are_refused(override, says):
    (line,) = problems(overrides=[override])
    assert line.startswith(override.split("=")[0] + ":") and says in line, line


def test_yaml_1_1_numbers_and_booleans_in_a_file_stay_text(tmp_path):
    """PyYAML read 010 in a file as 8, 1:30 as 90 and yes as true, where the command line
    kept them as text: a file now reads them as the command line does."""
    cfg = load_config(write(tmp_path, "agent:\n  a: 1:30\n  b: yes\n  c: 0x10\n  d: 010\n"
                                      "  e: 1_000\n  f: True\n  g: 1.5\n  h: {i: off}\n"))
    assert cfg.select("agent") == {"a": "1:30", "b": "yes", "c": "0x10", "d": "010", "e": 1000,
                                   "f": True, "g": 1.5, "h": {"i": "off"}}
    (line,) = problems(write(tmp_path, "trainer:\n  total_steps: 010\n"))
    assert line == "trainer.total_steps: value '010' must be a positive integer"
    assert load_config(None, ["agent.x={n: 010, m: on}"]).agent["x"] == {"n": "010", "m": "on"}


def test_a_later_override_of_a_section_adds_to_the_earlier_ones():
    """``trainer={save_freq: 2}`` after ``trainer.total_steps=3`` replaced the section the
    earlier override had built, and the run took 100 steps, the default."""
    cfg = load_config(None, ["trainer.total_steps=3", "trainer={save_freq: 2}",
                             "agent.x.y=1", "agent={x: {z: 2}}"])
    assert cfg.trainer.total_steps == 3 and cfg.trainer.save_freq == 2
    assert cfg.select("agent") == {"x": {"y": 1, "z": 2}}
    assert load_config(None, ["agent.x={y: 1}", "agent.x=5"]).agent["x"] == 5
