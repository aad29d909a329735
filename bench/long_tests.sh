#!/bin/sh
# The long forms of the suite's fault and load tests; `make test` runs their short forms (each test's
# docstring says what its short form runs). One test file at a time, as `make test` runs it:
#
#     bench/long_tests.sh chaos [SECONDS]      # tests/jobs/test_job_chaos.py, both backends (default 300 s each)
#     bench/long_tests.sh broker [RESTARTS]    # tests/faults/test_broker_restarts.py (default 5 restarts)
#     bench/long_tests.sh load [CLIENTS JOBS]  # tests/jobs/test_job_load.py (default 32 clients x 50 jobs)
#
# bench/README.md ("Long forms of the suite's fault and load tests") lists them.
set -eu
cd "$(dirname "$0")/.."
what=${1:-}
case "$what" in
chaos)
    seconds=${2:-300}
    export CHAOS_SECONDS="$seconds" CHAOS_KUBERNETES_SECONDS="$seconds"
    file=tests/jobs/test_job_chaos.py ;;
broker)
    export BROKER_RESTARTS="${2:-5}"
    file=tests/faults/test_broker_restarts.py ;;
load)
    export LOAD_CLIENTS="${2:-32}" LOAD_JOBS_PER_CLIENT="${3:-50}"
    file=tests/jobs/test_job_load.py ;;
*)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2 ;;
esac
exec make test PYTEST_ARGS="-n 0 -s $file"
