#!/usr/bin/env bash
# Waits for a job of scripts/gpu/detach.sh to end or SECONDS to pass, then prints the tail of
# its log and packs the job's folder plus any LOGDIRs named after it into $OUT/NAME.tgz (the
# one file a device call brings back). Call it again within the machine's idle limit to keep
# waiting. Exit status: the job's, 124 while it still runs.
# Usage: scripts/gpu/wait.sh NAME SECONDS [LOGDIR...]
set -uo pipefail
name=${1:?usage: wait.sh NAME SECONDS [LOGDIR...]}
seconds=${2:?usage: wait.sh NAME SECONDS [LOGDIR...]}
shift 2
dir=${STRIX_JOBS:-/tmp/strix-jobs}/$name
[ -d "$dir" ] || { echo "wait.sh: no job $name in $(dirname "$dir")" >&2; exit 2; }
end=$(($(date +%s) + seconds))
while [ ! -e "$dir/rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 2; done
tail -n 40 "$dir/log"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/$name.tgz" "$dir" "$@" 2> /dev/null
fi
if [ -e "$dir/rc" ]; then
  echo "job $name ended: exit $(cat "$dir/rc")"
  exit "$(cat "$dir/rc")"
fi
echo "job $name still running after ${seconds}s"
exit 124
