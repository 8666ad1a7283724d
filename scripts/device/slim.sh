#!/usr/bin/env bash
# The device tool copies every tracked file (64 MiB in all, carry included); the tracked
# tree is larger. `slim.sh on` takes the fixtures no device script reads out of the index
# (and ignores them) for the duration of a run; `slim.sh off` puts them back exactly as
# HEAD has them. The files on disk are never touched.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# SLIM_PATHS (space-separated) overrides the default list; `off` reads back what `on` took.
kept=.git/slim-paths
list=${SLIM_PATHS:-fixtures/gemma4}
[ "${1:-}" = off ] && [ -s "$kept" ] && list=$(cat "$kept")
read -r -a SLIM <<<"$list"
ex=.git/info/exclude
# While slim, a commit would record the fixtures as deleted: a pre-commit hook refuses.
hook=.git/hooks/pre-commit
mkdir -p .git/hooks
case ${1:?usage: slim.sh on|off} in
on)
  [ -e "$hook" ] && ! grep -q "slim.sh is on" "$hook" && { echo "slim.sh: $hook exists; not touching it" >&2; exit 1; }
  printf '#!/bin/sh\necho "slim.sh is on (fixtures out of the index): run scripts/device/slim.sh off first" >&2\nexit 1\n' >"$hook"
  chmod +x "$hook"
  git rm -r -q --cached "${SLIM[@]}"
  echo "$list" >"$kept"
  for p in "${SLIM[@]}"; do grep -qxF "/$p" "$ex" || echo "/$p" >>"$ex"; done
  echo "tracked: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes" ;;
off)
  for p in "${SLIM[@]}"; do sed -i "\#^/$p\$#d" "$ex"; done
  git reset -q -- "${SLIM[@]}"
  grep -q "slim.sh is on" "$hook" 2>/dev/null && rm -f "$hook"
  rm -f "$kept"
  git status --short -- "${SLIM[@]}" ;;
*) echo "usage: slim.sh on|off" >&2; exit 2 ;;
esac
