#!/usr/bin/env bash
# Prove the Mooncake fixes on SGLang releases that have no CI leg (0.5.13 ... 0.5.22):
# for each release, build a throw-away venv (scripts/setup_venv.sh; needs
# requirements/sglang-<release>.txt), run the unit tests and the Mooncake fix tests
# with SGLANG_DISAGG_EXT_REQUIRE_ALL=1, print one summary line, delete the venv.
#
#   scripts/release_sweep.sh <release>...
#
# The differential tests run stock ("mooncake") and "mooncake-ext" on the release's
# real wheel; a fix is only tested where releases.py marks it live for that release
# (a fix marked uncovered there is skipped, and listed as such in the summary).
# Logs: $SWEEP_LOG_DIR/<release>.log (default /tmp/sweep). Exit status: 1 if any
# release failed to build or had a failing test. Run one sweep at a time (CPU-bound).
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: release_sweep.sh <release>..." >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${SWEEP_LOG_DIR:-/tmp/sweep}
mkdir -p "$logs"
cd "$root"
# SWEEP_TESTS replaces the default list (a sweep for one fix); SWEEP_EXTRA_TESTS adds to it.
default_tests="test/unit
  test/integration/test_mooncake_state_pairing.py
  test/integration/test_mooncake_threads.py
  test/integration/test_mooncake_ext.py
  test/integration/test_metrics.py
  test/integration/test_mooncake_isolation.py"
tests=(${SWEEP_TESTS:-$default_tests} ${SWEEP_EXTRA_TESTS:-})
status=0
summaries=()
for release in "$@"; do
  venv=".venv-sweep-$release"
  log="$logs/$release.log"
  start=$(date +%s)
  if ! scripts/setup_venv.sh "$release" "$venv" >"$log" 2>&1; then
    summaries+=("$release: venv build FAILED (see $log)")
    status=1
    rm -rf "$venv"
    continue
  fi
  fixes=$("$venv/bin/python" -c 'from sglang_disagg_ext import releases as r; p = r.current_policy(); print(p.support.value, "live:", ",".join(p.active_fixes()) or "-")')
  SGLANG_DISAGG_EXT_REQUIRE_ALL=1 "$venv/bin/python" -m pytest -q -rfs -p no:cacheprovider -n "${PYTEST_WORKERS:-4}" "${tests[@]}" >>"$log" 2>&1
  rc=$?
  result=$(grep -E '^[=]* *[0-9]+ (passed|failed)|^[=]* *(no tests ran)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  [ $rc -eq 0 ] || status=1
  summaries+=("$release: pytest rc=$rc; $result; $fixes; $(( $(date +%s) - start )) s; log $log")
  rm -rf "$venv"
done
printf '%s\n' "${summaries[@]}"
exit $status
