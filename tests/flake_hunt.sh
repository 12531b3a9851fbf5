#!/usr/bin/env bash
# Run pytest N times with the same arguments, optionally beside a busy loop on one core, and print how many runs
# passed. Each run is a fresh pytest process, so module fixtures (one training run shared by a file's tests) run
# again every time: a race inside such a run is hunted too, which pytest plugins that repeat test items cannot do.
#
#   bash tests/flake_hunt.sh 20 --busy -- -n 0 tests/test_apex.py -k torchrun   # one test, 20 times, one core busy
#   bash tests/flake_hunt.sh 5 --                                                 # the whole suite, as CI runs it
#
# Exit status 0 only if every run passed; the logs of failed runs stay in the folder printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: flake_hunt.sh N [--busy] -- [pytest arguments]}
shift
busy=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --busy) busy=1 ;;
    *) echo "error: unknown option $1 (expected --busy, then -- and pytest's arguments)" >&2; exit 2 ;;
  esac
  shift
done
[ "${1:-}" = "--" ] && shift
logs=$(mktemp -d -t flake-hunt-XXXX)
hog=
if [ "$busy" = 1 ]; then
  python3 -c 'while True: pass' &
  hog=$!
  trap 'kill $hog 2>/dev/null' EXIT
fi
passed=0
failed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  log="$logs/run-$i.log"
  if python -m pytest -p no:cacheprovider "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    result=passed
  else
    failed=$((failed + 1))
    result="FAILED (log: $log)"
  fi
  echo "run $i/$runs: $result in $(($(date +%s) - start)) s: $(tail -n 1 "$log" | tr -d '=')"
  [ "$result" = passed ] && rm "$log"
done
echo "flake hunt: $passed of $runs runs passed$([ "$busy" = 1 ] && echo ', beside a busy core'); logs of failures in $logs"
[ "$failed" = 0 ]
