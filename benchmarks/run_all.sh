#!/usr/bin/env bash
# Every throughput number in the README's Results section: run on an otherwise idle machine, one after the other
# (they measure CPU throughput, so never in parallel). Writes benchmarks/results/*.json and prints each table.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
run() { echo; echo "\$ $*"; "$@" 2>&1 | grep -v -E "^A\.L\.E|Powered by Stella"; }
run python benchmarks/env_throughput.py
run python benchmarks/cleanba_throughput.py
run python benchmarks/hts_throughput.py
run python benchmarks/hts_straggler.py
run python benchmarks/a3c_throughput.py
run python benchmarks/gala_throughput.py --breakout
run python benchmarks/impala_throughput.py
run python benchmarks/apex_throughput.py
run python benchmarks/throughput.py --seconds 40 --stds-ms 0 20 --straggler-seconds 20
