"""The inference server's command line per device, from config."""

from __future__ import annotations

import re

import pytest

from app.config import ConfigError, load_config
from app.services.commands import inference_command


def argv(*overrides: str) -> tuple[list[str], dict[str, str]]:
    cmd = inference_command(load_config(None, list(overrides)))
    return cmd.argv, cmd.env


def opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_cpu_command():
    args, env = argv("inference.device=cpu", "inference.cpu_threads=1")
    assert "--enforce-eager" in args and opt(args, "--distributed-executor-backend") == "uni"
    assert opt(args, "--kv-cache-memory-bytes") == "67108864"
    assert "--enable-sleep-mode" not in args and "--gpu-memory-utilization" not in args
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert opt(args, "--generation-config") == "vllm"  # a model's sampling defaults never apply


def test_gpu_command_collocated():
    args, env = argv("inference.device=cuda", "inference.gpu_memory_utilization=0.4",
                     "inference.tensor_parallel_size=2", "inference.data_parallel_size=4")
    assert "--enable-sleep-mode" in args  # the update pauses the gateway on CUDA (auto)
    assert "--enforce-eager" not in args  # CUDA graphs
    assert opt(args, "--gpu-memory-utilization") == "0.4"
    assert opt(args, "--tensor-parallel-size") == "2" and opt(args, "--data-parallel-size") == "4"
    # no CPU-only flags or environment
    assert "--kv-cache-memory-bytes" not in args and "--distributed-executor-backend" not in args
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS",
                "VLLM_CPU_OMP_THREADS_BIND"} & set(env)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert opt(args, "--generation-config") == "vllm"  # a model's sampling defaults never apply


def test_gpu_command_not_collocated_and_forced_eager():
    args, _ = argv("inference.device=cuda", "trainer.pause_during_update=false",
                   "inference.enforce_eager=true")
    assert "--enable-sleep-mode" not in args and "--enforce-eager" in args


def test_sleep_mode_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="inference.sleep_mode: value true is refused"):
        load_config(None, ["inference.device=cpu", "inference.sleep_mode=true"])


def test_drain_mode_keep_keeps_the_engine_awake():
    # calls frozen across the update hold the engine's KV cache: auto does not sleep it
    args, _ = argv("inference.device=cuda", "gateway.drain_mode=keep")
    assert "--enable-sleep-mode" not in args
    args, _ = argv("inference.device=cuda", "gateway.drain_mode=abort")
    assert "--enable-sleep-mode" in args


def test_drain_mode_keep_with_sleep_mode_true_is_refused():
    with pytest.raises(ConfigError, match="gateway.drain_mode: value 'keep' cannot work with "
                                          "inference.sleep_mode true"):
        load_config(None, ["inference.device=cuda", "inference.sleep_mode=true",
                           "gateway.drain_mode=keep"])
    with pytest.raises(ConfigError, match="gateway.drain_mode: value 'later' must be one of"):
        load_config(None, ["gateway.drain_mode=later"])


def test_weight_sync_transfer_turns_on_the_projects_transfer_engine():
    import json

    args, _ = argv("inference.device=cpu", "inference.weight_sync=transfer")
    assert json.loads(opt(args, "--weight-transfer-config")) == {"backend": "carryover_shm"}
    args, _ = argv("inference.device=cpu")
    assert "--weight-transfer-config" not in args  # disk, the default


def test_transfer_engine_is_cuda_ipc_on_shared_gpus_and_shm_elsewhere():
    import json

    from app.config.settings import InferenceSettings, transfer_engine

    def engine(*overrides: str) -> tuple[str, dict[str, str], str]:
        over = ["inference.weight_sync=transfer", *overrides]
        args, env = argv(*over)
        served = InferenceSettings.from_config(load_config(None, over)).transfer_engine
        return json.loads(opt(args, "--weight-transfer-config"))["backend"], env, served

    # collocated on GPU (pause_during_update auto): vLLM's CUDA IPC engine, whose HTTP
    # route takes pickled handles; the trainer reads the same choice
    backend, env, trainer_side = engine("inference.device=cuda", "trainer.device=cuda")
    assert backend == trainer_side == "ipc"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    # servers on GPUs of their own, or asked for: the project's shared-memory engine
    # (a CPU trainer has no GPU memory to hand over)
    for over in (["trainer.pause_during_update=false"], ["inference.transfer_engine=shm"],
                 ["trainer.device=cpu"]):
        backend, env, trainer_side = engine("inference.device=cuda", "trainer.device=cuda",
                                            *over)
        assert (backend, trainer_side) == ("carryover_shm", "shm")
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    backend, _, trainer_side = engine("inference.device=cpu")
    assert (backend, trainer_side) == ("carryover_shm", "shm")
    with pytest.raises(ConfigError, match="inference.transfer_engine: value 'ipc' hands GPU "
                                          "memory over"):
        load_config(None, ["inference.device=cpu", "inference.transfer_engine=ipc"])
    with pytest.raises(ConfigError, match="ipc' hands GPU memory over .*trainer.device is cpu"):
        load_config(None, ["inference.device=cuda", "trainer.device=cpu",
                           "inference.transfer_engine=ipc"])
    # device auto is resolved where the server starts: on a host with no GPU, a config
    # error there too (the CLI's exit 2), not a traceback
    auto = load_config(None, ["inference.weight_sync=transfer", "inference.transfer_engine=ipc"])
    with pytest.raises(ConfigError, match="the servers run on cpu: use shm or auto"):
        transfer_engine(auto, "cpu")
    with pytest.raises(ConfigError, match="inference.transfer_engine: value 'nccl' must be"):
        load_config(None, ["inference.transfer_engine=nccl"])


def test_weight_sync_transfer_to_a_server_on_another_host_is_refused():
    with pytest.raises(ConfigError, match=r"inference.weight_sync: value 'transfer' hands the "
                                          r"weights over in this host's shared memory.*"
                                          r"http://10.0.0.5:8100"):
        load_config(None, ["inference.weight_sync=transfer",
                           "inference.urls=[http://127.0.0.1:8100,http://10.0.0.5:8100]"])
    with pytest.raises(ConfigError, match="trainer.nnodes 2 does not promise"):
        load_config(None, ["inference.weight_sync=transfer", "trainer.nnodes=2"])
    with pytest.raises(ConfigError, match="inference.weight_sync: value 'nccl' must be one of"):
        load_config(None, ["inference.weight_sync=nccl"])
    with pytest.raises(ConfigError, match="inference.transfer_bucket_mb"):
        load_config(None, ["inference.transfer_bucket_mb=0"])


def test_lora_serves_adapters_at_run_time_up_to_the_rank():
    args, env = argv("inference.device=cpu", "actor_rollout_ref.model.lora_rank=12")
    assert "--enable-lora" in args and opt(args, "--max-lora-rank") == "16"  # vLLM's next
    assert opt(args, "--max-loras") == "2" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert opt(args, "--max-cpu-loras") == "3"
    # on GPU one API server: each keeps its own table of adapters
    args, _ = argv("inference.device=cuda", "actor_rollout_ref.model.lora_rank=8",
                   "inference.data_parallel_size=4")
    assert opt(args, "--api-server-count") == "1"
    args, env = argv("inference.device=cpu")
    assert "--enable-lora" not in args and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.model.lora_rank=1024"], "above the largest rank vLLM serves"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[lm_head]"],
     "actor_rollout_ref.model.target_modules: value \\['lm_head'\\] names lm_head"),
    (["actor_rollout_ref.model.lora_rank=8", "gateway.drain_mode=keep"],
     "gateway.drain_mode: value 'keep' cannot work with a LoRA adapter"),
    (["actor_rollout_ref.model.lora_rank=8", "inference.weight_sync=transfer"],
     "inference.weight_sync: value 'transfer' sends whole weights"),
    (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank"),
    (["actor_rollout_ref.model.lora_rank=8", "inference.sleep_level=2"],
     "inference.sleep_level: value 2 drops the base weights"),
    (["actor_rollout_ref.model.lora_rank=8", "trainer.keep_weight_versions=1"],
     "trainer.keep_weight_versions: with actor_rollout_ref.model.lora_rank"),
])
def test_a_lora_setting_the_servers_cannot_serve_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_gateway_names_the_adapter_of_the_calls_version():
    from gateway.settings import GatewaySettings

    lora = GatewaySettings.from_config(load_config(None, ["actor_rollout_ref.model.lora_rank=8"]))
    assert [lora.served_model(v) for v in (0, 1, 7)] == [
        "tiny-qwen2", "tiny-qwen2-v1", "tiny-qwen2-v7"]  # 0: nothing published yet
    full = GatewaySettings.from_config(load_config(None, []))
    assert full.served_model(7) == "tiny-qwen2"


def test_ipc_is_taken_only_where_the_trainers_gpus_are_the_servers():
    """Every trainer rank exports each bucket on its GPU, and an export no server worker
    opens is GPU memory lost (torch frees it once its reader releases it): a second server
    out of a sync, or a trainer GPU no server uses, leaked each sync. auto takes shm
    there, and ipc named is a config error naming the layout."""
    from app.config.settings import transfer_engine

    gpu = ["inference.weight_sync=transfer", "inference.device=cuda", "trainer.device=cuda"]
    two = "inference.urls=[http://127.0.0.1:8100,http://127.0.0.1:8101]"
    assert transfer_engine(load_config(None, gpu), "cuda") == "ipc"
    # 8 ranks under Ray over one server of 2 x 4 GPUs: the same GPUs
    eight = [*gpu, "trainer.n_gpus_per_node=8", "inference.tensor_parallel_size=2",
             "inference.data_parallel_size=4"]
    assert transfer_engine(load_config(None, eight), "cuda") == "ipc"
    for layout, says in ((two, "inference.urls names 2"),
                         ("trainer.ranks=2", "the trainer has 2 rank(s), the server 1 GPU(s)"),
                         ("trainer.n_gpus_per_node=8", "the trainer has 8 rank(s)")):
        assert transfer_engine(load_config(None, [*gpu, layout]), "cuda") == "shm", layout
        with pytest.raises(ConfigError, match="inference.transfer_engine: value 'ipc' .*"
                                              + re.escape(says)):
            load_config(None, [*gpu, layout, "inference.transfer_engine=ipc"])
