#!/usr/bin/env bash
# `make test`'s test passes, side by side. The suite runs on three pytest workers; beside it run the two
# passes that mostly wait: the soak's CI variant (a steady 15 calls/s for three minutes) and the
# unprivileged pass (scripts/test-unprivileged.sh: about a minute of sandbox tests, a quarter of it on
# a CPU). Each side pass's output is printed whole once it ends; the exit status is non-zero if any
# pass failed. WORKERS overrides the number of workers: on two cores, three took the suite from 11:57
# to 10:55 (the machine was 80% busy), and two put CI at 908 s, over its 15 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
logs=$(mktemp -d /tmp/bastion-test-passes.XXXXXX)
side=()
trap 'for p in "${side[@]}"; do kill "$p" 2>/dev/null; done; wait; rm -rf "$logs"' EXIT

# The servers the tests build put their sandboxes' cgroups under a base group "bastion" in each hierarchy
# (CgroupLayout.detect), which a server keeps: removed at the end, once every pass is over, if this run made it.
bases_before=$(ls -d /sys/fs/cgroup/bastion /sys/fs/cgroup/*/bastion 2>/dev/null)

soak=tests/load/test_soak.py
BASTION_TESTS_KEEP_CGROUP_BASES=1 "$venv/bin/pytest" -q -p no:cacheprovider --basetemp="$logs/soak-tmp" "$soak" >"$logs/soak.log" 2>&1 &
side+=($!)
if [ "$(id -u)" = 0 ]; then
  bash scripts/test-unprivileged.sh >"$logs/unprivileged.log" 2>&1 &
  side+=($!)
else
  echo "skipping the unprivileged pass: it needs root to create the user and the cgroup"
fi

status=0
BASTION_TESTS_KEEP_CGROUP_BASES=1 "$venv/bin/pytest" -q -n "${WORKERS:-3}" --dist loadfile --ignore="$soak" || status=1
for pass in soak unprivileged; do
  [ ${#side[@]} -gt 0 ] || break
  pid=${side[0]}
  side=("${side[@]:1}")
  wait "$pid" || { status=1; echo "== the $pass pass FAILED"; }
  echo "== the $pass pass:"
  cat "$logs/$pass.log"
done
for base in /sys/fs/cgroup/bastion /sys/fs/cgroup/*/bastion; do
  [ -d "$base" ] && ! grep -qxF "$base" <<<"$bases_before" && ! rmdir "$base" 2>/dev/null &&
    { status=1; echo "== sandbox cgroups left behind under $base:"; find "$base" -mindepth 1 -type d; }
done
exit $status
