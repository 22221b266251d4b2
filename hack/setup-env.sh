#!/usr/bin/env bash
# Creates ./.venv for this checkout. The heavy dependencies (torch alone is several GB) live in a
# shared virtualenv under $HOME/.cache keyed on the lock (requirements/lock.txt), so a fresh clone on
# the same machine reuses it; ./.venv itself only links to it and installs this project editable.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { echo "[setup] $*" >&2; }

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "error: Python >= 3.10 is needed ('$python' is missing or older); set PYTHON=/path/to/python3" >&2
  exit 2
fi

# The locked set (requirements/lock.txt, from `make lock`) is the only input: refuse a stale one.
"$python" hack/lock.py check
key="$( (cat requirements/lock.txt; "$python" -VV) | sha256sum | cut -c1-12)"
cache_root="${SHARDED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sharded-training}"
deps_venv="$cache_root/venv-$key"
# Every locked file, as downloaded (hashes checked): the virtualenv and both images install from here.
wheelhouse="$cache_root/wheelhouse"

if [ ! -f "$deps_venv/.complete" ]; then
  log "downloading the locked Python dependencies into $wheelhouse"
  log "first time only: torch and its CUDA libraries are several GB (3-10 minutes); later runs reuse them"
  mkdir -p "$wheelhouse"
  "$python" -m pip download --progress-bar on --no-deps --require-hashes -r requirements/lock.txt -d "$wheelhouse"
  log "installing them into $deps_venv"
  rm -rf "$deps_venv"
  "$python" -m venv "$deps_venv"
  "$deps_venv/bin/python" -m pip install -q --no-index --find-links "$wheelhouse" --no-deps --require-hashes \
    -r requirements/lock.txt
  touch "$deps_venv/.complete"
else
  log "reusing Python dependencies in $deps_venv"
fi

site="$("$deps_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The project's own entry points and packages come from pyproject.toml too: a change there re-links .venv.
stamp="$deps_venv $(cat pyproject.toml requirements/lock.txt | sha256sum | cut -c1-12)"
if [ ! -f .venv/.deps ] || [ "$(cat .venv/.deps)" != "$stamp" ]; then
  rm -rf .venv
  # No pip or setuptools of its own: the shared site's (newer) ones are found through the .pth below.
  "$python" -m venv --without-pip .venv
  local_site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # addsitedir (not a bare path) so the shared site's own .pth files are processed too.
  echo "import site; site.addsitedir('$site')" > "$local_site/_sharded_deps.pth"
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  # Console scripts of the dependencies, run by this checkout's interpreter so the project is importable.
  for tool in ruff lint-imports torchrun kopf pytest deepspeed shellcheck hadolint; do
    if [ -e "$deps_venv/bin/$tool" ] && ! head -c2 "$deps_venv/bin/$tool" | grep -q '#!'; then
      ln -sf "$deps_venv/bin/$tool" ".venv/bin/$tool"  # a native binary (ruff)
    elif [ -e "$deps_venv/bin/$tool" ]; then
      printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$root/.venv/bin/python" "$deps_venv/bin/$tool" > ".venv/bin/$tool"
      chmod +x ".venv/bin/$tool"
    fi
  done
  echo "$stamp" > .venv/.deps
fi
log "ready: $root/.venv"
