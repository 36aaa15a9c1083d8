#!/usr/bin/env bash
# The whole pytest suite in two pytest processes at once: tests/test_packaging.py (packages, chroots, repositories, the
# VM image: mostly waiting on PyPI, Debian's mirror, dpkg and qemu) beside everything else. On the 2-core machine the
# two in turn took 48 minutes; side by side the wall time is about the longer of the two. The packaging tests already
# serve on random 127.x.y.z addresses of their own, so the two runs share no port, folder or process group.
# Usage: tools/test_beside.sh PYTEST [ARGS...]; the packaging run's report is printed after the rest's, and the exit
# status is the first failing run's (pytest's 5, "no tests collected", counts as a failure: never pass on nothing).
set -uo pipefail
pytest_bin=$1
shift
cd "$(dirname "$0")/.."
side_log=$(mktemp "${TMPDIR:-/tmp}/packaging-tests.XXXXXX.log")
"$pytest_bin" -q -p no:cacheprovider "$@" tests/test_packaging.py >"$side_log" 2>&1 &
side=$!
trap 'kill "$side" 2>/dev/null; wait "$side" 2>/dev/null; exit 130' INT TERM
echo "tests/test_packaging.py runs beside the rest (its report follows theirs; live: $side_log)"
"$pytest_bin" -q "$@" --ignore=tests/test_packaging.py
rest=$?
wait "$side"
packaging=$?
trap - INT TERM
echo
echo "=================== tests/test_packaging.py (run beside the rest, exit $packaging) ==================="
cat "$side_log"
rm -f "$side_log"
if [ "$rest" -ne 0 ]; then exit "$rest"; fi
exit "$packaging"
