#!/usr/bin/env bash
# The GPU check, run on the GPU machine (Python 3.12 with CUDA torch and transformers, no
# internet), after scripts/gpu_wheels.sh, one device call per part of the wheels:
#   calls 1..N-1: carry .whl/partK     command: bash bench/gpu_check.sh stage
#   call N:       carry .whl/partN     command: bash bench/gpu_check.sh run [options]
# The machine keeps the parts carried before while it stays warm. "install" joins the wheels
# cut in pieces (checked against their SHA-256) and installs every wheel into $SITE
# (/tmp/site) without touching the machine's own packages; "run" installs, then runs
# python -m bench.gpu_trainer with the options (it exits 1 when a threshold is missed, 124
# past $CHECK_TIMEOUT_S, 420 s), its JSON to $OUT/gpu_trainer.json, its figures so far to
# $OUT/gpu_trainer.partial.json after each phase, its stderr to $OUT/gpu_trainer.stderr. scripts/gpu_mirror_env.sh runs "install" and the check in a
# CPU copy of the machine's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}

install() {
  ls .whl/part*/SHA256SUMS >/dev/null
  local wheels sums name
  wheels=$(mktemp -d)
  cp .whl/part*/*.whl "$wheels/"
  sums=$(ls .whl/part*/SHA256SUMS | head -1)
  while read -r _ name; do
    # the pieces, wherever each part put them, in their suffix order (aa, ab, ...)
    for p in .whl/part*/"$name".part-*; do echo "${p##*.part-} $p"; done | sort \
      | cut -d' ' -f2 | xargs cat > "$wheels/$name"
  done < "$sums"
  (cd "$wheels" && sha256sum -c --quiet "$OLDPWD/$sums") \
    || { echo "a joined wheel differs: carry every part first (ls .whl)" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$wheels"/*.whl
  rm -rf "$wheels"
}

case "${1:-}" in
  stage)
    nvidia-smi -L
    echo "staged: $(ls -d .whl/part* | tr '\n' ' ')($(du -sch .whl/part* | tail -1 | cut -f1))"
    # what the machine holds of the carried packages (the largest could be left behind)
    "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE "^(pyarrow|pandas|ray|datasets)==" \
      || true
    ;;
  install) install ;;
  run)
    out=${OUT:-/tmp}
    # what the machine holds, for reading a failure: its packages and NCCL
    "$PY" -m pip list --format=freeze > "$out/pip_list.txt" 2>&1 || true
    install
    export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
    "$PY" -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version()
              if torch.cuda.is_available() else "no CUDA")' || true
    # bounded below the call's own limit, so that what was written comes back; stderr (a
    # traceback) is kept whole beside the JSON, not only in the call's last lines
    timeout "${CHECK_TIMEOUT_S:-420}" "$PY" -m bench.gpu_trainer "${@:2}" \
      2> >(tee "$out/gpu_trainer.stderr" >&2) | tee "$out/gpu_trainer.json"
    ;;
  *) echo "usage: bench/gpu_check.sh stage|install|run [bench.gpu_trainer options]" >&2
     exit 2 ;;
esac
