#!/usr/bin/env bash
# A multi-host stack on this machine, one network namespace per host (bench/multihost.py):
#   scripts/multihost.sh up                 build the network, start every role, wait for them
#   scripts/multihost.sh status             namespaces, processes, links, health from the trainer
#   scripts/multihost.sh exec HOST CMD...   run CMD on HOST (its namespace, config and secrets)
#   scripts/multihost.sh cut|heal HOST      partition HOST from every other host, or heal it
#   scripts/multihost.sh cut|heal HOST PEER partition HOST and PEER from each other only
#   scripts/multihost.sh down [--all]       stop everything, delete the namespaces (a crashed
#                                           run's too; --all: every co-* stack, test runs' included)
# Needs root and iproute2. Everything runs at nice 19. Settings (environment):
# CARRYOVER_MH_DIR (run directory), CARRYOVER_MH_CONFIG (base config, config/demo.yaml),
# CARRYOVER_MH_PREFIX (namespace prefix, co-), CARRYOVER_MH_START_TIMEOUT_S (900).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$repo/.venv/bin/python"
if [[ $# -gt 0 && "$1" != -h && "$1" != --help && "$(id -u)" != 0 ]]; then
    echo "error: network namespaces need root (uid $(id -u))" >&2
    exit 1
fi
if [[ ! -x "$python" ]]; then
    echo "error: $python not found or not executable (scripts/setup.sh builds it)" >&2
    exit 1
fi
cd "$repo"
exec nice -n 19 "$python" -m bench.multihost "$@"
