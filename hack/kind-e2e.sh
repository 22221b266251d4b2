#!/usr/bin/env bash
# The kind end-to-end flow (what .github/workflows/e2e-kind.yaml runs), for anyone with Docker:
# create a kind cluster, build and load both images, install the chart, apply the CPU quickstart,
# wait for Succeeded, show the checkpoint files; dump logs and events on failure.
# `make kind-e2e` runs it here through hack/kindnode.py, which sets KIND_NODE_IMAGE and KIND_CONFIG (a node
# image made locally), BUILD_IMAGES=0 (the images hack/images.py built) and KIND_DELETE=1.
set -euo pipefail

cluster="${KIND_CLUSTER:-sharded-e2e}"
ns="${JOB_NAMESPACE:-default}"
version="0.1.0"
operator_image="${OPERATOR_IMAGE:-sharded-training/operator:$version}"
trainer_image="${TRAINER_IMAGE:-sharded-training/trainer:$version}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

diagnostics() {
  mkdir -p _diagnostics
  kubectl get stj,pods,pvc,events -A -o wide > _diagnostics/objects.txt 2>&1 || true
  kubectl get stj -A -o yaml > _diagnostics/jobs.yaml 2>&1 || true
  kubectl -n sharded-system logs deploy/sharded-training-operator > _diagnostics/operator.log 2>&1 || true
  for p in $(kubectl -n "$ns" get pods -o name 2>/dev/null); do
    kubectl -n "$ns" logs "$p" > "_diagnostics/${p#pod/}.log" 2>&1 || true
  done
  echo "diagnostics written to _diagnostics/" >&2
}
on_exit() {
  local rc=$?
  [ "$rc" -eq 0 ] || diagnostics
  # The cluster holds a copy of the trainer image (GBs): gone with the cluster where asked.
  [ "${KIND_DELETE:-0}" != 1 ] || kind delete cluster --name "$cluster" >&2 || true
  exit "$rc"
}
trap on_exit EXIT

echo "::group::kind cluster"
create=(kind create cluster --name "$cluster" --wait 180s)
[ -z "${KIND_NODE_IMAGE:-}" ] || create+=(--image "$KIND_NODE_IMAGE")
[ -z "${KIND_CONFIG:-}" ] || create+=(--config "$KIND_CONFIG")
kind get clusters | grep -qx "$cluster" || "${create[@]}"
echo "::endgroup::"

echo "::group::images"
if [ "${BUILD_IMAGES:-1}" != 0 ]; then
  docker build -f operator/Dockerfile -t "$operator_image" .
  docker build -f trainer/Dockerfile -t "$trainer_image" .
fi
kind load docker-image --name "$cluster" "$operator_image" "$trainer_image"
echo "::endgroup::"

echo "::group::chart"
helm upgrade --install sharded-training-operator charts/sharded-training-operator \
  --namespace sharded-system --create-namespace --wait --timeout 5m \
  --set image.pullPolicy=Never
echo "::endgroup::"

echo "::group::quickstart"
# kind's default storage is node-local (ReadWriteOnce) and a CI runner has few cores: adjust the
# example accordingly rather than keep a second copy of it. The control plane asks for 1.2 CPUs of the
# node's, beside the rendezvous pod's 0.25: on a 2-core machine each training pod may ask for 0.25 at most.
sed -e 's/accessModes: \[ReadWriteMany\]/accessModes: [ReadWriteOnce]/' -e "s/cpu: 2\$/cpu: ${QUICKSTART_CPU:-500m}/" \
  examples/quickstart-cpu.yaml | kubectl -n "$ns" apply -f -
kubectl -n "$ns" wait stj/quickstart --for=jsonpath='{.status.phase}'=Succeeded --timeout=15m
kubectl -n "$ns" get stj quickstart -o wide
# The trainer's progress reports reach the operator through its Service (cluster DNS, then kube-proxy):
# status.progress holds the last step.
step="$(kubectl -n "$ns" get stj quickstart -o jsonpath='{.status.progress.step}')"
want="$(kubectl -n "$ns" get stj quickstart -o jsonpath='{.spec.trainer.steps}')"
if [ "$step" != "$want" ]; then
  echo "status.progress.step is '$step', not $want: progress reports did not reach the operator" >&2
  exit 1
fi
echo "::endgroup::"

echo "::group::checkpoints"
# The trainer image lists them: it is on the node already, and nothing is pulled.
kubectl -n "$ns" run ckpt-ls --restart=Never --image="$trainer_image" --image-pull-policy=Never \
  --overrides='{"spec":{"volumes":[{"name":"c","persistentVolumeClaim":{"claimName":"quickstart-checkpoints"}}],
    "containers":[{"name":"ls","image":"'"$trainer_image"'","imagePullPolicy":"Never","command":["ls","-lR","/c"],
    "volumeMounts":[{"name":"c","mountPath":"/c"}]}]}}'
kubectl -n "$ns" wait pod/ckpt-ls --for=jsonpath='{.status.phase}'=Succeeded --timeout=2m
kubectl -n "$ns" logs ckpt-ls
echo "::endgroup::"
