#!/usr/bin/env bash
# The GPU check's environment, mirrored on a CPU machine: Python 3.12 with torch 2.11 and
# transformers 5.17 (what the GPU machine has preinstalled), plus the wheels
# scripts/gpu_wheels.sh carries there, installed as bench/gpu_check.sh installs them
# (--no-deps into a separate site folder, the machine's own packages untouched). Whatever
# breaks here (an import, a version verl or the trainer cannot live with) would break there.
#
#   scripts/gpu_mirror_env.sh        # builds var/gpu-mirror, then runs the tiny check in it
#
# PyPI's torch 2.11 is a CUDA build (a few GB with its CUDA libraries); it runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
find_py312() {  # a Python 3.12 that runs (a pyenv shim may exist and refuse)
  local c
  for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$c" -c '' 2>/dev/null; then echo "$c"; return; fi
  done
  echo "no Python 3.12 found: set PY312" >&2; exit 1
}
PY312=${PY312:-$(find_py312)}
ENV=var/gpu-mirror
say() { printf '\033[1m[gpu-mirror]\033[0m %s\n' "$*"; }

if [[ ! -x $ENV/venv/bin/python ]]; then
  say "Python 3.12 venv with torch 2.11.0 and transformers 5.17.0 (the GPU machine's)"
  rm -rf "$ENV" && mkdir -p "$ENV"
  "$PY312" -m venv "$ENV/venv"
  # the machine's constraint file caps torch for the project's own venvs; this one pins
  PIP_CONSTRAINT= "$ENV/venv/bin/pip" install -q "torch==2.11.0" "transformers==5.17.0"
fi
ls .whl/part*/SHA256SUMS >/dev/null 2>&1 || bash scripts/gpu_wheels.sh
say "the carried wheels, installed as bench/gpu_check.sh installs them on the machine"
rm -rf "$ENV/site"
PYTHON="$ENV/venv/bin/python" SITE="$ENV/site" bash bench/gpu_check.sh install
say "$("$ENV/venv/bin/python" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"
PYTHONPATH="$PWD/$ENV/site:$PWD" "$ENV/venv/bin/python" -m bench.gpu_trainer --tiny --kl \
  --dynamic-bsz "$@"
