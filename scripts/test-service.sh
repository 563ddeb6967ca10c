#!/usr/bin/env bash
# Runs deploy/bastion.service under a real systemd, both ways (as the user bastion, and as root with
# bastion.service.d/root.conf and disk_quota = true), and drives each with an MCP client through
# sandboxes, terminals, snapshots and a host workspace (tests/systemd/service_client.py).
#
# The systemd is a throwaway one: systemd-nspawn boots this machine's /usr with an overlay on /etc and
# everything else in memory, so `bastion install-service` really creates the user, folders, config and
# unit, and nothing of it outlives the container. Needs root and systemd-nspawn (Debian: systemd-container).
# Called by `make service-test` (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [ "$(id -u)" != 0 ]; then echo "scripts/test-service.sh: run as root" >&2; exit 1; fi
command -v systemd-nspawn >/dev/null || { echo "systemd-nspawn is missing: apt-get install systemd-container" >&2; exit 1; }

# The service's bastion, on the system's python3 and outside /root, /home and /tmp (the unit hides those).
work=$(mktemp -d /opt/bastion-service-test.XXXXXX)
chmod 0755 "$work"  # the service user runs the venv in it
venv=$work/.venv
UV_PROJECT_ENVIRONMENT=$venv UV_PYTHON_DOWNLOADS=never .tools/bin/uv sync --frozen --quiet --python /usr/bin/python3
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
hybrid=0; [ -f /sys/fs/cgroup/cgroup.controllers ] || hybrid=1
controllers=(memory pids cpu cpuacct)
group=bastion-service-test-$$
nspawn=

cleanup() {
  if [ -n "$nspawn" ] && kill -0 "$nspawn" 2>/dev/null; then kill -KILL "$nspawn"; fi
  wait 2>/dev/null || true
  if [ "$hybrid" = 1 ]; then
    for c in "${controllers[@]}"; do
      [ -d "/sys/fs/cgroup/$c/$group" ] && find "/sys/fs/cgroup/$c/$group" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Boot a container; sets $nspawn and $init (the container's PID 1).
boot() {
  local log=$work/boot.log devices=()
  for node in /dev/loop*; do devices+=("--bind=$node"); done  # disk_quota's loop devices
  if [ "$hybrid" = 1 ]; then
    # The container's cgroup namespace (and every cgroup bastion makes in it) sits below $group.
    for c in "${controllers[@]}"; do mkdir -p "/sys/fs/cgroup/$c/$group"; echo $$ > "/sys/fs/cgroup/$c/$group/cgroup.procs"; done
  fi
  setsid systemd-nspawn -D / --volatile=yes --overlay=/etc::/etc -b --register=no --keep-unit --console=passive \
    --bind="$repo" --bind="$work" "${devices[@]}" >"$log" 2>&1 </dev/null &
  nspawn=$!
  if [ "$hybrid" = 1 ]; then
    for c in "${controllers[@]}"; do echo $$ > "/sys/fs/cgroup/$c/cgroup.procs"; done
  fi
  for _ in $(seq 300); do
    init=$(ps -o pid= --ppid "$nspawn" | head -1 | tr -d ' ')
    state=
    if [ -n "$init" ] && [ "$(readlink "/proc/$init/ns/pid")" != "$(readlink /proc/self/ns/pid)" ]; then
      state=$(nsenter -t "$init" -a systemctl is-system-running 2>/dev/null || true)
    fi
    if [ "$state" = running ] || [ "$state" = degraded ]; then
      if [ "$hybrid" = 1 ]; then
        # nspawn shows the v1 hierarchies read-only; on a systemd host root may write them.
        for c in "${controllers[@]}"; do nsenter -t "$init" -m mount -o remount,bind,rw "/sys/fs/cgroup/$c"; done
      fi
      return 0
    fi
    sleep 0.2
  done
  echo "the container did not boot; its console:" >&2; tail -20 "$log" >&2; return 1
}

inside() { nsenter -t "$init" -a "$@"; }

# A v1/v2 hybrid host cannot delegate memory, pids and cpu to an unprivileged service; systemd does it
# on a pure v2 host. This drop-in (test only) hands the user's service its own v1 groups instead.
hybrid_drop_in() {
  local bastion=$venv/bin/bastion
  cat <<EOF
[Service]
ExecStartPre=+/bin/sh -c 'for c in ${controllers[*]}; do mkdir -p /sys/fs/cgroup/\$\$c/bastion.service; chown bastion:bastion /sys/fs/cgroup/\$\$c/bastion.service /sys/fs/cgroup/\$\$c/bastion.service/cgroup.procs; done'
ExecStart=
ExecStart=/bin/sh -c 'for c in ${controllers[*]}; do echo \$\$\$\$ > /sys/fs/cgroup/\$\$c/bastion.service/cgroup.procs; done; exec $bastion serve --config /etc/bastion/bastion.toml --http'
EOF
}

run_mode() {
  local mode=$1 flags=()
  [ "$mode" = root ] && flags=(--as-root)
  echo "=== bastion.service as $mode"
  boot || return 1
  inside "$venv/bin/bastion" install-service --exec "$venv/bin/bastion" "${flags[@]}" | grep -v '^ok '
  # The client below speaks plain HTTP without OAuth: auth off, which bastion allows on loopback only.
  inside sed -i -e "s/127.0.0.1:8765/127.0.0.1:$port/g" -e 's/^\[http\]$/[http]\nauth = false/' /etc/bastion/bastion.toml
  if [ -n "${EXTRA_DROP_IN:-}" ]; then  # to measure one setting's effect: a drop-in that changes it
    inside mkdir -p /etc/systemd/system/bastion.service.d
    inside tee /etc/systemd/system/bastion.service.d/zz-extra.conf <"$EXTRA_DROP_IN" >/dev/null
    inside systemctl daemon-reload
  fi
  if [ "$mode" = user ] && [ "$hybrid" = 1 ]; then
    inside mkdir -p /etc/systemd/system/bastion.service.d
    hybrid_drop_in | inside tee /etc/systemd/system/bastion.service.d/zz-test-hybrid.conf >/dev/null
    inside systemctl daemon-reload
  fi
  local status=0
  inside systemctl start bastion.service || status=1
  inside systemctl show -p ActiveState -p StatusText bastion.service
  if [ $status = 0 ]; then
    PYTHONPATH="$repo/src:$repo" "$venv/bin/python" -m tests.systemd.service_client "http://127.0.0.1:$port/mcp" || status=1
  fi
  inside systemctl stop bastion.service
  # A traceback, an error, or a folder whose mode the unit disagrees with fails the mode. (Sandboxes
  # log "landlock: not applied" here: nspawn's own seccomp filter refuses landlock_create_ruleset to
  # everything in the container, the unit aside.)
  if inside journalctl -u bastion.service -o cat | grep -E 'Traceback|ERROR|mode is different'; then status=1; fi
  if [ $status != 0 ]; then inside journalctl -u bastion.service -o cat | tail -${JOURNAL_LINES:-15}; fi
  if inside findmnt -rn -o TARGET | grep -q '^/var/lib/bastion'; then echo "mounts left behind" >&2; status=1; fi
  kill -TERM "$nspawn"; wait "$nspawn" || true; nspawn=
  return $status
}

failed=0
for mode in ${MODES:-user root}; do run_mode "$mode" || failed=1; done
[ $failed = 0 ] && echo "service test: both ways passed" || echo "service test: FAILED" >&2
exit $failed
