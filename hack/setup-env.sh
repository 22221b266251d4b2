#!/usr/bin/env bash
# Creates ./.venv for this checkout. The heavy dependencies (torch alone is several GB) live in a
# shared virtualenv under $HOME/.cache keyed on pyproject.toml's dependency lists, so a fresh clone on
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

# Dependencies of every extra, one per line; the cache key is their hash plus the interpreter.
deps="$("$python" - <<'PY'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import pip._vendor.tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
reqs = list(project["dependencies"])
for extra in ("operator", "trainer", "dev"):
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
)"
key="$( (echo "$deps"; "$python" -VV) | sha256sum | cut -c1-12)"
cache_root="${SHARDED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sharded-training}"
deps_venv="$cache_root/venv-$key"

if [ ! -f "$deps_venv/.complete" ]; then
  log "installing Python dependencies into $deps_venv"
  log "first time only: torch and its CUDA libraries are several GB (3-10 minutes); later runs reuse them"
  rm -rf "$deps_venv"
  "$python" -m venv "$deps_venv"
  "$deps_venv/bin/python" -m pip install --progress-bar on -q --upgrade pip setuptools wheel
  # shellcheck disable=SC2086
  echo "$deps" | tr '\n' '\0' | xargs -0 "$deps_venv/bin/python" -m pip install --progress-bar on
  touch "$deps_venv/.complete"
else
  log "reusing Python dependencies in $deps_venv"
fi

site="$("$deps_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The project's own entry points and packages come from pyproject.toml too: a change there re-links .venv.
stamp="$deps_venv $(sha256sum pyproject.toml | cut -c1-12)"
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
