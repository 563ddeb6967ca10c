#!/usr/bin/env bash
# Runs the sandbox tests as an unprivileged user inside a delegated cgroup subtree, the way
# systemd's Delegate= hands one to a service user (see deploy/bastion.service). Root sets up
# the user and the subtree; everything under test runs as the user. Called by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

user=bastion-ci
group=bastion-ci-$$
home=$(mktemp -d /tmp/bastion-ci-home.XXXXXX)
made_user=
if ! id "$user" >/dev/null 2>&1; then
  useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
  made_user=1  # removed at the end: the machine is left as it was found
fi
chown "$user" "$home"

# The hierarchies bastion uses: pure cgroup v2, or v1 controllers (+ the v2 tree) on a hybrid host.
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  roots=(/sys/fs/cgroup)
  for c in memory pids cpu; do echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true; done
else
  roots=()
  for c in memory pids cpu cpuacct unified; do [ -d "/sys/fs/cgroup/$c" ] && roots+=("/sys/fs/cgroup/$c"); done
fi

cleanup() {
  for r in "${roots[@]}"; do
    echo $$ > "$r/cgroup.procs" 2>/dev/null || true
    [ -d "$r/$group" ] && find "$r/$group" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  rm -rf "$home"
  [ -z "$made_user" ] || userdel "$user" 2>/dev/null || echo "user $user not removed: remove it with 'userdel $user'"
}
trap cleanup EXIT

for r in "${roots[@]}"; do
  mkdir "$r/$group"
  chown -R "$user" "$r/$group"
  echo $$ > "$r/$group/cgroup.procs"
done

# The user must be able to run the venv's interpreter; a Python under root's home (pyenv)
# is not, so such a machine gets a second venv on the system's python3.
venv=.venv
if ! runuser -u "$user" -- "$venv/bin/python" -c "" 2>/dev/null; then
  venv=.venv-unprivileged
  UV_PROJECT_ENVIRONMENT="$venv" UV_PYTHON_DOWNLOADS=never .tools/bin/uv sync --frozen --quiet --python /usr/bin/python3
fi

tests=(tests/sandbox/test_connect.py tests/sandbox/test_warm.py tests/sandbox/inside/test_landlock.py tests/sandbox/test_seccomp.py
       tests/sandbox/test_cgroups.py tests/workbench/test_manager.py tests/workbench/test_isolation.py
       tests/workbench/test_processes.py tests/workbench/test_templates.py tests/workbench/test_workspace.py
       tests/workbench/test_code.py tests/workbench/test_network.py
       tests/test_doctor.py tests/attacks/test_host_workspace_git_attacks.py)
echo "running the sandbox tests as $user in cgroup $group"
runuser -u "$user" -- env HOME="$home" PATH="$PATH" \
  "$venv/bin/pytest" -q -p no:cacheprovider --basetemp="$home/pytest" "${tests[@]}"
