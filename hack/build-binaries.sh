#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, helm), Kueue, the gang schedulers (Volcano, scheduler-plugins) and actionlint from Go
# modules into a cache under $HOME. Each binary is cached under its own name and version
# (hack/versions.env), so bumping one tool rebuilds only that tool.
# `bash hack/build-binaries.sh kind` also builds what the kind node image needs (hack/kindnode.py): kind,
# kubeadm, kube-proxy and local-path-provisioner; the suite does not.
# Prints a directory of links to the binaries on the last line of stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

log() { echo "[control-plane] $*" >&2; }

cache_root="${SHARDED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sharded-training}"
store="$cache_root/binaries"        # <name>@<version>, immutable once built
work="$cache_root/go-wrappers"      # one wrapper Go module per tool and version
bin_dir="$cache_root/bin-$(sha256sum "$here/versions.env" | cut -c1-12)"
mkdir -p "$store" "$work" "$bin_dir"
# One builder at a time per cache (make demo and make test may start together, and a test builds helm):
# two `go build`s of one tool would race on its .tmp output; the second waits, then finds it built.
exec 9>"$cache_root/.build.lock"
flock 9

declare -A version=(
  [kube-apiserver]=$KUBERNETES_VERSION [kube-controller-manager]=$KUBERNETES_VERSION
  [kube-scheduler]=$KUBERNETES_VERSION [kubectl]=$KUBERNETES_VERSION [kubelet]=$KUBERNETES_VERSION [etcd]=$ETCD_VERSION
  [kwok]=$KWOK_VERSION-$(sha256sum "$here/patches/kwok-pod-uid.patch" | cut -c1-8) [helm]=$HELM_VERSION [actionlint]=$ACTIONLINT_VERSION [kueue]=$KUEUE_VERSION
  [vc-scheduler]=$VOLCANO_VERSION-apis-$VOLCANO_APIS_VERSION [vc-controller-manager]=$VOLCANO_VERSION-apis-$VOLCANO_APIS_VERSION
  [coscheduler]=$SCHEDULER_PLUGINS_VERSION
  [coredns]=$COREDNS_VERSION-$(sha256sum "$here/coredns/main.go" | cut -c1-8)
  [kind]=$KIND_VERSION [kubeadm]=$KUBERNETES_VERSION [kube-proxy]=$KUBERNETES_VERSION
  [local-path-provisioner]=$LOCAL_PATH_PROVISIONER_VERSION
)
order=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet etcd kwok helm actionlint kueue
       vc-scheduler vc-controller-manager coscheduler coredns)
extras=(kind kubeadm kube-proxy local-path-provisioner)
if [ "${1:-}" = kind ]; then order+=("${extras[@]}"); fi

missing=0
for b in "${order[@]}"; do
  [ -x "$store/$b@${version[$b]}" ] || missing=$((missing + 1))
done
if [ "$missing" -gt 0 ]; then
  if ! command -v go >/dev/null 2>&1; then
    echo "error: the Go toolchain (go >= 1.26) is needed to build the local control plane;" \
         "install it (https://go.dev/doc/install) and put 'go' on PATH" >&2
    exit 2
  fi
  log "building $missing binaries from source into $store (first run only): expect 10-40 minutes on 2 cores"
fi

export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0

# A wrapper module per tool: `go install pkg@version` refuses modules whose go.mod has replace
# directives, and k8s.io/kubernetes points every staging module at ./staging.
wrapper() {  # wrapper MODULE VERSION -> prints the wrapper's directory
  local dir="$work/${1//\//_}@$2"
  if [ ! -f "$dir/.ready" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    (cd "$dir" && go mod init local.build/wrapper >/dev/null 2>&1)
    if [ "$1" = "k8s.io/kubernetes" ]; then
      local gomod staging="v0.${2#v1.}"
      gomod="$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$2" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
      # Every `k8s.io/X => ./staging/src/k8s.io/X` becomes the published k8s.io/X v0.<minor>.<patch>.
      grep -oE '^[[:space:]]*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' \
        | while read -r m; do
            (cd "$dir" && go mod edit -replace "$m=$m@$staging")
          done
    fi
    (cd "$dir" && go mod edit -require "$1@$2")
    touch "$dir/.ready"
  fi
  echo "$dir"
}

# KWOK with hack/patches/kwok-pod-uid.patch: its pod deletes and status patches carry the pod's UID, as a
# kubelet's do. Unpatched, a delete played from a stale event or a retry removes a new pod that reuses the
# name (the operator reuses pod names across attempts). Prints the patched module's wrapper directory.
patched_kwok() {
  local dir="$work/sigs.k8s.io_kwok@${version[kwok]}" src
  if [ ! -f "$dir/.ready" ]; then
    src="$(cd "$(wrapper sigs.k8s.io/kwok "$KWOK_VERSION")" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    rm -rf "$dir" && mkdir -p "$dir/src"
    cp -R "$src/." "$dir/src/" && chmod -R u+w "$dir/src"
    (cd "$dir/src" && git apply -p1 "$here/patches/kwok-pod-uid.patch")
    (cd "$dir" && go mod init local.build/wrapper >/dev/null 2>&1 \
      && go mod edit -require "sigs.k8s.io/kwok@$KWOK_VERSION" -replace "sigs.k8s.io/kwok=./src")
    touch "$dir/.ready"
  fi
  echo "$dir"
}

# A module built as the main module, from a writable copy of its source: Volcano and scheduler-plugins pin
# their Kubernetes libraries with replace directives, which hold only in the main module. REPLACE (optional,
# "old=new@version") stands in for a module the published source lacks. Prints the copy's directory.
main_module() {  # main_module MODULE VERSION [REPLACE]
  local dir="$work/src-${1//\//_}@$2" src
  if [ ! -f "$dir/.ready" ]; then
    src="$(cd "$(wrapper "$1" "$2")" && go mod download -json "$1@$2" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    rm -rf "$dir" && mkdir -p "$dir"
    cp -R "$src/." "$dir/" && chmod -R u+w "$dir"
    if [ -n "${3:-}" ]; then (cd "$dir" && go mod edit -replace "$3"); fi
    touch "$dir/.ready"
  fi
  echo "$dir"
}

step=0
build() {  # build NAME MODULE PACKAGE [LDFLAGS]
  local name="$1" module="$2" pkg="$3" ldflags="${4:-}" ver="${version[$1]}"
  step=$((step + 1))
  local out="$store/$name@$ver"
  if [ ! -x "$out" ]; then
    log "[$step/${#order[@]}] $name $ver: building $pkg (several minutes on 2 cores)"
    local start=$SECONDS dir
    case "$name" in
      kwok) dir="$(patched_kwok)" ;;
      vc-*) dir="$(main_module volcano.sh/volcano "$VOLCANO_VERSION" "volcano.sh/apis=volcano.sh/apis@$VOLCANO_APIS_VERSION")" ;;
      coscheduler) dir="$(main_module sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS_VERSION")" ;;
      coredns) dir="$(wrapper github.com/coredns/coredns "$COREDNS_VERSION")" && cp "$here/coredns/main.go" "$dir/" ;;
      *) dir="$(wrapper "$module" "$ver")" ;;
    esac
    (cd "$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$out.tmp" "$pkg")
    mv "$out.tmp" "$out"
    log "[$step/${#order[@]}] $name: built in $((SECONDS - start))s"
  fi
  ln -sf "$out" "$bin_dir/$name"
}

k8s_minor="${KUBERNETES_VERSION#v1.}"
k8s_minor="${k8s_minor%%.*}"
ver=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ver+=" -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$k8s_minor"
  ver+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
  build "$b" k8s.io/kubernetes "k8s.io/kubernetes/cmd/$b" "$ver"
done
build etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3
build kwok sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
build helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
build actionlint github.com/rhysd/actionlint github.com/rhysd/actionlint/cmd/actionlint \
  "-X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"
build kueue sigs.k8s.io/kueue sigs.k8s.io/kueue/cmd/kueue
# Kueue's CRDs and webhook manifests, from the same module version as the binary (hack/kueue.py applies them).
kueue_config="$store/kueue-config@$KUEUE_VERSION"
if [ ! -d "$kueue_config" ]; then
  src="$(cd "$(wrapper sigs.k8s.io/kueue "$KUEUE_VERSION")" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  mkdir -p "$kueue_config.tmp/crd" "$kueue_config.tmp/webhook"
  cp "$src"/config/components/crd/bases/*.yaml "$kueue_config.tmp/crd/"
  cp "$src/config/components/webhook/manifests.yaml" "$kueue_config.tmp/webhook/"
  chmod -R u+w "$kueue_config.tmp" && mv "$kueue_config.tmp" "$kueue_config"
fi
ln -sfn "$kueue_config" "$bin_dir/kueue-config"

# The gang schedulers, each from its own module as its release builds it: Volcano's scheduler and controller
# manager, and scheduler-plugins' kube-scheduler (which has the coscheduling plugin compiled in).
build vc-scheduler volcano.sh/volcano ./cmd/scheduler
build vc-controller-manager volcano.sh/volcano ./cmd/controller-manager
build coscheduler sigs.k8s.io/scheduler-plugins ./cmd/scheduler
# Cluster DNS for the real nodes: hack/coredns/main.go, CoreDNS with only the plugins the local stack needs.
build coredns github.com/coredns/coredns . "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION"
# Their CRDs, and the scheduler configuration Volcano's chart installs, from the same module versions.
volcano_config="$store/volcano-config@$VOLCANO_VERSION"
if [ ! -d "$volcano_config" ]; then
  src="$(main_module volcano.sh/volcano "$VOLCANO_VERSION" "volcano.sh/apis=volcano.sh/apis@$VOLCANO_APIS_VERSION")"
  mkdir -p "$volcano_config.tmp/crd"
  cp "$src"/config/crd/volcano/bases/*.yaml "$volcano_config.tmp/crd/"
  cp "$src/installer/helm/chart/volcano/config/volcano-scheduler.conf" "$volcano_config.tmp/"
  mv "$volcano_config.tmp" "$volcano_config"
fi
ln -sfn "$volcano_config" "$bin_dir/volcano-config"
coscheduling_config="$store/coscheduling-config@$SCHEDULER_PLUGINS_VERSION"
if [ ! -d "$coscheduling_config" ]; then
  src="$(main_module sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS_VERSION")"
  mkdir -p "$coscheduling_config.tmp"
  cp "$src/manifests/coscheduling/crd.yaml" "$coscheduling_config.tmp/"
  mv "$coscheduling_config.tmp" "$coscheduling_config"
fi
ln -sfn "$coscheduling_config" "$bin_dir/coscheduling-config"

if [ "${1:-}" = kind ]; then
  for b in kubeadm kube-proxy; do
    build "$b" k8s.io/kubernetes "k8s.io/kubernetes/cmd/$b" "$ver"
  done
  build kind sigs.k8s.io/kind sigs.k8s.io/kind
  build local-path-provisioner github.com/rancher/local-path-provisioner github.com/rancher/local-path-provisioner
  # kind's node-image files (entrypoint, systemd units, containerd and kubelet settings), from the same module.
  kind_files="$store/kind-files@$KIND_VERSION"
  if [ ! -d "$kind_files" ]; then
    src="$(cd "$(wrapper sigs.k8s.io/kind "$KIND_VERSION")" && go list -m -f '{{.Dir}}' sigs.k8s.io/kind)"
    cp -R "$src/images/base/files" "$kind_files.tmp" && chmod -R u+w "$kind_files.tmp"
    mv "$kind_files.tmp" "$kind_files"
  fi
  ln -sfn "$kind_files" "$bin_dir/kind-files"
  lps="$store/local-path-storage@$LOCAL_PATH_PROVISIONER_VERSION.yaml"
  if [ ! -f "$lps" ]; then
    src="$(cd "$(wrapper github.com/rancher/local-path-provisioner "$LOCAL_PATH_PROVISIONER_VERSION")" \
      && go list -m -f '{{.Dir}}' github.com/rancher/local-path-provisioner)"
    cp "$src/deploy/local-path-storage.yaml" "$lps.tmp" && chmod u+w "$lps.tmp" && mv "$lps.tmp" "$lps"
  fi
  ln -sf "$lps" "$bin_dir/local-path-storage.yaml"
fi

[ "$missing" -eq 0 ] || log "all binaries ready"
echo "$bin_dir"
