#!/usr/bin/env bash
# The whole test suite, from nothing: set up, then pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
set +e
python -m pytest -q "$@"
status=$?
set -e
# pytest exits 5 when it collects no tests; that is not a failure of the suite.
if [ "$status" -eq 5 ]; then exit 0; fi
exit "$status"
