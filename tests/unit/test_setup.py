"""scripts/setup.sh picks the environment per device (dry run: nothing is installed)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO


def dry_run(tmp_path, device: str | None = None, gpu: bool = False) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n" if gpu else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CARRYOVER_DEVICE", None)
    if device is not None:
        env["CARRYOVER_DEVICE"] = device
    return subprocess.run(["bash", "scripts/setup.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("device,gpu,want", [(None, False, "cpu"), (None, True, "cuda"),
                                             ("cpu", True, "cpu"), ("cuda", False, "cuda")])
def test_device_choice(tmp_path, device, gpu, want):
    out = dry_run(tmp_path, device, gpu)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"device: {want}")
    lock = "project-cuda.lock" if want == "cuda" else "project.lock"
    assert f"requirements/{lock}" in out.stdout
    assert f"requirements/vllm-{want}.lock" in out.stdout


def test_a_bad_device_is_one_clear_line(tmp_path):
    out = dry_run(tmp_path, "gpu")
    assert out.returncode == 2
    assert "CARRYOVER_DEVICE must be cpu, cuda or auto (got 'gpu')" in out.stderr


def test_the_locks_agree_on_torch_and_vllm():
    def pins(name: str) -> dict[str, str]:
        lines = (REPO / "requirements" / name).read_text().splitlines()
        return dict(ln.split("==", 1) for ln in lines if "==" in ln and not ln.startswith("#"))

    assert pins("project.lock")["torch"] == "2.13.0+cpu"
    assert pins("vllm-cpu.lock")["torch"] == "2.13.0+cpu"
    assert pins("project-cuda.lock")["torch"] == "2.13.0"
    assert pins("vllm-cuda.lock")["torch"] == "2.13.0"
    assert pins("vllm-cuda.lock")["vllm"] == pins("vllm-cpu.lock")["vllm-cpu"] == "0.32.0"
    # the CUDA project lock is the CPU one with the CUDA build of torch added
    cpu, cuda = pins("project.lock"), pins("project-cuda.lock")
    assert {k: v for k, v in cpu.items() if k != "torch"}.items() <= cuda.items()


def test_status_reports_the_environment(monkeypatch):
    """``carryover status`` names the device, torch's build and the vLLM build (read without
    importing torch or vLLM)."""
    from app.services import device
    from app.services.health import environment

    device.host_device.cache_clear()
    monkeypatch.setenv("CARRYOVER_DEVICE", "cuda")
    rows = dict(environment())
    device.host_device.cache_clear()
    assert rows["device"] == "cuda"
    # read off torch's own version file: the CPU build says None
    import torch

    assert rows["torch"] == f"{torch.__version__} (CUDA {torch.version.cuda})"
    assert rows["torch"].startswith("2.13.0")
    vllm_venv = REPO / ".venv-vllm"
    assert rows["vllm"].startswith(("vllm-cpu 0.32.0", "vllm 0.32.0") if vllm_venv.is_dir()
                                   else ("not installed",))
