#!/bin/bash
# The core's round modules compiled by Cython, unchanged (transaction, passes, generation, scheduler, rounds), against
# the pure ones: processes alternating, each running docs/evidence/bench_drafts/host-2026-12-06/inprocess.py (10
# requests of 192 tokens on an engine of one sequence). DIR holds a copy of power_core with the compiled modules beside
# their sources (Cython's build_ext --inplace, language_level 3, binding=True) and links to the repository's tests/ and
# docs/. Usage, from the repository root: cython_ab.sh DIR mtp|dflash PAIRS
dir=$1; mode=${2:-mtp}; pairs=${3:-4}; root=$(pwd)
for i in $(seq "$pairs"); do
  echo "compiled $(cd "$dir" && "$root/.nox/tests/bin/python" docs/evidence/bench_drafts/host-2026-12-06/inprocess.py 10 "$mode" | head -1)"
  echo "pure     $(.nox/tests/bin/python docs/evidence/bench_drafts/host-2026-12-06/inprocess.py 10 "$mode" | head -1)"
done
