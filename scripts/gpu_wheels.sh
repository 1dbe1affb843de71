#!/usr/bin/env bash
# Wheels for the GPU check machine (Python 3.12, CUDA torch and transformers preinstalled, no
# internet): verl 0.9.1 and what importing its FSDP engine and running the trainer needs that
# the machine lacks. The set is the one scripts/gpu_mirror_env.sh proved: the check passes in a
# Python 3.12 environment holding torch 2.11 and transformers 5.17 (and what they depend on)
# plus exactly these wheels. Written to .whl/ (ignored by git) in parts under the 64 MiB that
# one device call can carry: a wheel over 26 MiB (Ray, pyarrow) is cut into pieces, and
# bench/gpu_check.sh joins them (checked against their SHA-256) before installing.
#
#   scripts/gpu_wheels.sh            # download into .whl/part1 .. partN, then print sizes
#
# Each part is one device call's carry; the machine keeps ignored files between calls while
# it stays warm (30 s idle).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
rm -rf "$OUT" && mkdir -p "$OUT/all"

# name==version pins from the project's lock where it has one (the versions CI tests)
pin() { grep -i "^$1==" requirements/project.lock || echo "$1"; }
# (not wandb, hydra-core, torchdata or pylatexenc, which verl names: the check passes with
# them made unimportable, and wandb alone is 19 MiB of the carry)
PACKAGES=(verl ray tensordict pyvers importlib_metadata orjson codetiming datasets dill
          multiprocess omegaconf uvicorn fastapi starlette pydantic pydantic_core
          annotated-types typing-inspection opentelemetry-api jsonschema
          jsonschema-specifications referencing rpds-py redis annotated-doc
          colorful wcwidth
          # found missing in the mirror: Ray's own (msgpack, protobuf, requests, urllib3,
          # attrs, cloudpickle), what verl's engine import reaches through datasets (pandas,
          # python-dateutil and its six, pyarrow, xxhash, pillow), and what its FSDP engine loads (peft,
          # accelerate)
          msgpack protobuf requests urllib3 attrs cloudpickle pandas python-dateutil pyarrow
          xxhash pillow peft accelerate six)
# published only as source: pure Python, so a wheel built here installs on 3.12 there
SOURCE_ONLY=(antlr4-python3-runtime)
SPECS=()
for p in "${PACKAGES[@]}"; do SPECS+=("$(pin "$p")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$OUT/all" "${SPECS[@]}"
for p in "${SOURCE_ONLY[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w "$OUT/all" "$(pin "$p")"
done

# cut the large wheels, then pack every file into parts of at most 60 MiB, largest first
(cd "$OUT/all" && for w in *.whl; do
  if (( $(stat -c %s "$w") > 26 * 1024 * 1024 )); then
    sha256sum "$w" >> SHA256SUMS
    split -b 26M "$w" "$w.part-"
    rm "$w"
  fi
done)
"$PY" - "$OUT" <<'PACK'
import shutil, sys
from pathlib import Path
out = Path(sys.argv[1])
files = sorted((p for p in (out / "all").iterdir() if p.name != "SHA256SUMS"),
               key=lambda p: p.stat().st_size, reverse=True)
limit, parts = 60 * 2**20, []
for f in files:
    size = f.stat().st_size
    for part in parts:
        if part[0] + size <= limit:
            part[0] += size
            part[1].append(f)
            break
    else:
        parts.append([size, [f]])
for i, (_, members) in enumerate(parts, start=1):
    d = out / f"part{i}"
    d.mkdir()
    shutil.copy(out / "all" / "SHA256SUMS", d)
    for f in members:
        shutil.move(str(f), d / f.name)
PACK
rm -rf "$OUT/all"
du -sh "$OUT"/part*
