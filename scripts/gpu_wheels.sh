#!/usr/bin/env bash
# Wheels for the GPU check machine (Python 3.12, CUDA torch and transformers preinstalled, no
# internet): verl 0.9.1 and what importing its FSDP engine needs that the machine lacks, plus
# what the project's trainer imports. Written to .whl/ (ignored by git), in parts under the
# 64 MiB that one device call can carry: Ray's wheel (about 76 MiB) is split in two, and
# bench/gpu_check.sh joins the parts (checked against their SHA-256) before installing.
#
#   scripts/gpu_wheels.sh            # download into .whl/, then print the parts' sizes
#
# Each part is one device call's carry: .whl/part1 (a third of Ray and every other wheel),
# then .whl/part2 (the rest of Ray); the machine keeps ignored files between calls while it
# stays warm (30 s idle).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude
rm -rf "$OUT" && mkdir -p "$OUT/all" "$OUT/part1" "$OUT/part2"

# name==version pins from the project's lock where it has one (the versions CI tests)
pin() { grep -i "^$1==" requirements/project.lock || echo "$1"; }
PACKAGES=(verl ray tensordict pyvers importlib_metadata orjson codetiming datasets dill
          multiprocess omegaconf hydra-core uvicorn fastapi starlette pydantic pydantic_core
          annotated-types typing-inspection opentelemetry-api jsonschema
          jsonschema-specifications referencing rpds-py redis torchdata wandb annotated-doc
          colorful wcwidth)
# published only as source: pure Python, so a wheel built here installs on 3.12 there
SOURCE_ONLY=(antlr4-python3-runtime pylatexenc)
SPECS=()
for p in "${PACKAGES[@]}"; do SPECS+=("$(pin "$p")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$OUT/all" "${SPECS[@]}"
for p in "${SOURCE_ONLY[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w "$OUT/all" "$(pin "$p")"
done

ray=$(ls "$OUT"/all/ray-*.whl)
sha256sum "$ray" | sed "s#$OUT/all/##" > "$OUT/part1/ray.sha256"
split -b 26M "$ray" "$OUT/part1/$(basename "$ray").part-"   # aa, ab, ac
mv "$OUT"/part1/*.part-ab "$OUT"/part1/*.part-ac "$OUT/part2/"
cp "$OUT/part1/ray.sha256" "$OUT/part2/"
find "$OUT/all" -name '*.whl' ! -name 'ray-*' -exec mv {} "$OUT/part1/" \;
rm -rf "$OUT/all"
du -sh "$OUT"/part1 "$OUT"/part2
