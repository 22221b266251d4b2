#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, helm) from Go modules into a cache under $HOME, keyed on hack/versions.env.
# Prints the cache's bin directory on the last line of stdout. Progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

log() { echo "[control-plane] $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go >= 1.26) is needed to build the local control plane;" \
       "install it (https://go.dev/doc/install) and put 'go' on PATH" >&2
  exit 2
fi

key="$(sha256sum "$here/versions.env" | cut -c1-12)"
cache_root="${SHARDED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sharded-training}"
bin_dir="$cache_root/control-plane-$key/bin"
work="$cache_root/control-plane-$key/src"
mkdir -p "$bin_dir" "$work"

k8s_minor="${KUBERNETES_VERSION#v1.}"
k8s_minor="${k8s_minor%%.*}"
staging_version="v0.${KUBERNETES_VERSION#v1.}"
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0

# A wrapper module per tool: `go install pkg@version` refuses modules whose go.mod has replace
# directives, and k8s.io/kubernetes points every staging module at ./staging.
wrapper() {  # wrapper NAME MODULE VERSION -> prints the wrapper's directory
  local dir="$work/$1"
  mkdir -p "$dir"
  if [ ! -f "$dir/.ready" ]; then
    (cd "$dir" && rm -f go.mod && go mod init "local.build/$1" >/dev/null 2>&1)
    if [ "$2" = "k8s.io/kubernetes" ]; then
      local gomod
      gomod="$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$3" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
      # Every `k8s.io/X => ./staging/src/k8s.io/X` becomes the published k8s.io/X v0.<minor>.<patch>.
      grep -oE '^[[:space:]]*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' \
        | while read -r m; do
            (cd "$dir" && go mod edit -replace "$m=$m@$staging_version")
          done
    fi
    (cd "$dir" && go mod edit -require "$2@$3")
    touch "$dir/.ready"
  fi
  echo "$dir"
}

build() {  # build STEP NAME WRAPPER PACKAGE [LDFLAGS]
  local step="$1" name="$2" dir="$3" pkg="$4" ldflags="${5:-}"
  if [ -x "$bin_dir/$name" ]; then
    log "[$step] $name: cached"
    return
  fi
  log "[$step] $name: building $pkg (first build only; several minutes on 2 cores)"
  local start=$SECONDS
  (cd "$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$bin_dir/$name.tmp" "$pkg")
  mv "$bin_dir/$name.tmp" "$bin_dir/$name"
  log "[$step] $name: built in $((SECONDS - start))s"
}

missing=0
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm; do
  [ -x "$bin_dir/$b" ] || missing=$((missing + 1))
done
if [ "$missing" -eq 0 ]; then
  echo "$bin_dir"
  exit 0
fi
log "cache: $bin_dir"
log "building $missing binaries from source (first run only): expect 10-40 minutes on 2 cores"

k8s="$(wrapper kubernetes k8s.io/kubernetes "$KUBERNETES_VERSION")"
ver=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ver+=" -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$k8s_minor"
  ver+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build 1/7 kube-apiserver "$k8s" k8s.io/kubernetes/cmd/kube-apiserver "$ver"
build 2/7 kube-controller-manager "$k8s" k8s.io/kubernetes/cmd/kube-controller-manager "$ver"
build 3/7 kube-scheduler "$k8s" k8s.io/kubernetes/cmd/kube-scheduler "$ver"
build 4/7 kubectl "$k8s" k8s.io/kubernetes/cmd/kubectl "$ver"

etcd="$(wrapper etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION")"
build 5/7 etcd "$etcd" go.etcd.io/etcd/server/v3

kwok="$(wrapper kwok sigs.k8s.io/kwok "$KWOK_VERSION")"
build 6/7 kwok "$kwok" sigs.k8s.io/kwok/cmd/kwok \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"

helm="$(wrapper helm helm.sh/helm/v3 "$HELM_VERSION")"
build 7/7 helm "$helm" helm.sh/helm/v3/cmd/helm \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

log "all binaries ready"
echo "$bin_dir"
