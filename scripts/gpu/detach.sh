#!/usr/bin/env bash
# Starts a command that must outlive the call that starts it (a device machine's `run` kills
# what its command leaves behind in its own session when the command ends): in a new session
# (setsid), stdin closed, its output in JOBS/NAME/log and its exit status in JOBS/NAME/rc when
# it ends. JOBS is $STRIX_JOBS or /tmp/strix-jobs. Pair with scripts/gpu/wait.sh.
# Usage: scripts/gpu/detach.sh NAME COMMAND [ARGS...]
set -euo pipefail
name=${1:?usage: detach.sh NAME COMMAND [ARGS...]}
shift
[ $# -gt 0 ] || { echo "detach.sh: no command" >&2; exit 2; }
dir=${STRIX_JOBS:-/tmp/strix-jobs}/$name
[ ! -e "$dir/pid" ] || [ -e "$dir/rc" ] || { echo "detach.sh: job $name is still running" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir"
setsid nohup bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" < /dev/null > /dev/null 2>&1 &
echo $! > "$dir/pid"
echo "started $name (pid $!): $dir"
