#!/usr/bin/env bash
# A cold `bash .ci/run`, as on a new machine with nothing cached: a fresh clone of HEAD, run with a scratch
# HOME (no virtualenv, wheelhouse, control-plane binaries, Go or pip caches) and a scratch TMPDIR (no
# Inductor cache), after removing the project's Docker images and dockerd's build cache (its image store is
# the machine's, not HOME's: the next `make test` builds them again). Each output line carries the minutes
# since the start; the last lines say how long the set-up (until the suite starts) and the suite took.
#
#   bash hack/cold-run.sh [WORKDIR]     # default: a new directory under /tmp
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/sharded-cold-XXXXXX)}"
mkdir -p "$work/home" "$work/tmp"
git clone -q "$root" "$work/repo"

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  mapfile -t ours < <(docker images --format '{{.Repository}}:{{.Tag}}' | grep -E '^sharded-(training|local)/' || true)
  if [ "${#ours[@]}" -gt 0 ]; then docker rmi -f "${ours[@]}" >/dev/null; fi
  docker image prune -f >/dev/null  # the classic builder's cache: the dangling layers of earlier builds
fi

start=$SECONDS
set +e
(cd "$work/repo" && HOME="$work/home" TMPDIR="$work/tmp" bash .ci/run 2>&1) | while IFS= read -r line; do
  t=$(( (SECONDS - start) / 6 ))  # tenths of a minute
  printf '%3d.%d %s\n' $((t / 10)) $((t % 10)) "$line"
done | tee "$work/ci.log"
rc=${PIPESTATUS[0]}
set -e
suite_at=$(grep -m1 '\[test\] unit, trainer' "$work/ci.log" | awk '{print $1}')
total=$(awk -v s=$((SECONDS - start)) 'BEGIN { print s / 60 }')
printf '[cold] exit %s; set-up (deps, images, lint) %s min, in all %.1f min; suite: %s\n' "$rc" "${suite_at:-?}" \
  "$total" "$(head -1 "$work/repo/build/suite-times.txt" 2>/dev/null || echo '?')"
exit "$rc"
