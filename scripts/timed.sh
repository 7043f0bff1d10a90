#!/usr/bin/env bash
# scripts/timed.sh NAME COMMAND...: runs COMMAND, prints its wall time, and
# appends "NAME<TAB>seconds<TAB>status" to $CI_STEP_TIMES when it is set
# (.ci/run sets it and prints every part in its table of where the time goes).
# Exits with COMMAND's status.
set -uo pipefail
name=$1; shift
t0=$(date +%s)
"$@"; rc=$?
dt=$(( $(date +%s) - t0 ))
status=ok; [ $rc = 0 ] || status="FAILED (exit $rc)"
printf '[time] %s: %d s (%s)\n' "$name" "$dt" "$status"
[ -n "${CI_STEP_TIMES:-}" ] && printf '%s\t%d\t%s\n' "$name" "$dt" "$status" >>"$CI_STEP_TIMES"
exit $rc
