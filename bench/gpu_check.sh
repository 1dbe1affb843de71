#!/usr/bin/env bash
# The GPU check, run on the GPU machine (Python 3.12 with CUDA torch and transformers, no
# internet), in two device calls after scripts/gpu_wheels.sh:
#   call 1: carry .whl/part1      command: bash bench/gpu_check.sh stage
#   call 2: carry .whl/part2      command: bash bench/gpu_check.sh run
# The machine keeps .whl/part1 between the calls while it stays warm. "run" joins Ray's wheel
# from its parts (checked against its SHA-256), installs every wheel into /tmp/site without
# touching the machine's own packages, and runs python -m bench.gpu_trainer; its JSON goes to
# $OUT/gpu_trainer.json.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  stage)
    ls .whl/part1 >/dev/null
    nvidia-smi -L
    echo "staged: $(du -sh .whl/part1 | cut -f1) (.whl/part1)"
    ;;
  run)
    [[ -d .whl/part1 && -d .whl/part2 ]] || { echo "both parts are needed: run 'stage' first" >&2; exit 2; }
    mkdir -p /tmp/wheels
    cp .whl/part1/*.whl /tmp/wheels/
    name=$(cut -d' ' -f3- < .whl/part1/ray.sha256)
    cat .whl/part1/"$name".part-* .whl/part2/"$name".part-* > "/tmp/wheels/$name"
    (cd /tmp/wheels && sha256sum -c "$OLDPWD/.whl/part1/ray.sha256")
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site /tmp/wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 -m bench.gpu_trainer "${@:2}" | tee "${OUT:-/tmp}/gpu_trainer.json"
    ;;
  *) echo "usage: bench/gpu_check.sh stage|run [bench.gpu_trainer options]" >&2; exit 2 ;;
esac
