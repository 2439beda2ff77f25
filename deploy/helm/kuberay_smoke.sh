#!/usr/bin/env bash
# Runs the chart's KubeRay head and worker containers, as rendered, without a cluster: both in podman, the worker in
# the head's network namespace (one loopback, like a pod network), with the environment KubeRay gives them (the
# generated `ray start` in KUBERAY_GEN_RAY_START_CMD, RAY_ADDRESS, token auth) and KubeRay's wait-for-GCS step in
# between. The head's Ray has no CPUs, so the engine can only run on the worker. Checks from the host: health
# SERVING, a generate call, and exit code 0 after SIGTERM to the head (the gateway drains, Ray stays up meanwhile).
# Needs the image from deploy/container/build_ci_image.sh and .venv with deploy/helm/install_helm.sh's packages.
#   bash deploy/helm/kuberay_smoke.sh
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
IMAGE="${IMAGE:-localhost/pagedserve:ci}"
PY="$REPO/.venv/bin/python"
export CONTAINERS_CONF="$REPO/deploy/container/containers.conf"
WORK="$(mktemp -d)"
die() { echo "[kuberay_smoke] FAILED: $*" >&2; podman logs --tail 30 kr-head 2>&1 | sed 's/^/[head log] /' >&2; exit 1; }
remove() {  # retried: right after a stop, podman's own exit cleanup can hold the container for a moment
    for _ in 1 2 3 4 5; do
        podman container exists "$1" || return 0
        podman rm -f -t 0 "$1" >/dev/null 2>&1 || sleep 1
    done
}
cleanup() { remove kr-worker; remove kr-head; rm -rf "$WORK"; }
trap cleanup EXIT
cleanup; mkdir -p "$WORK"

# The RayCluster as the chart renders it (CPU, one worker group; no HTTP API, as the checks below use gRPC).
"$PY" - "$REPO/deploy/helm/pagedserve" "$WORK" 2>"$WORK/render.err" <<'EOF' || { cat "$WORK/render.err" >&2; die "helm render"; }
import json, sys, helm_python as helm, yaml
values = {"mode": "kuberay", "server": {"httpApi": {"enabled": False}},
          "kuberay": {"workerGroups": [{"name": "cpu", "replicas": 1}]}}
with helm.Chart.load(sys.argv[1]) as chart:
    rc = yaml.safe_load(chart.render(values, name="smoke", namespace="default")["pagedserve/templates/raycluster.yaml"])
head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
worker = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
json.dump(head["command"], open(f"{sys.argv[2]}/head_command", "w"))
open(f"{sys.argv[2]}/head_args", "w").write("\n".join(head["args"]))
json.dump(worker["command"], open(f"{sys.argv[2]}/worker_command", "w"))
EOF
mapfile -t head_args <"$WORK/head_args"
auth=(-e RAY_AUTH_MODE=token -e "RAY_AUTH_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')")

podman run -d --name kr-head --no-healthcheck -p 127.0.0.1::50051 --shm-size=1g "${auth[@]}" -e RAY_ADDRESS=127.0.0.1:6379 \
    -e "KUBERAY_GEN_RAY_START_CMD=ray start --head --num-cpus=0 --port=6379 --include-dashboard=false --block" \
    --entrypoint "$(cat "$WORK/head_command")" "$IMAGE" "${head_args[@]}" >/dev/null 2>"$WORK/podman.err" ||
    { cat "$WORK/podman.err" >&2; die "podman run head"; }
podman run --rm --no-healthcheck --network container:kr-head "${auth[@]}" --entrypoint bash "$IMAGE" -c \
    'for _ in $(seq 90); do ray health-check --address 127.0.0.1:6379 >/dev/null 2>&1 && exit 0; sleep 2; done; exit 1' ||
    die "the head's GCS did not come up"
podman run -d --name kr-worker --no-healthcheck --network container:kr-head --shm-size=1g "${auth[@]}" -e RAY_ADDRESS=127.0.0.1:6379 \
    -e "KUBERAY_GEN_RAY_START_CMD=ray start --address=127.0.0.1:6379 --num-cpus=2 --dashboard-agent-listen-port=52366 --block" \
    --entrypoint "$(cat "$WORK/worker_command")" "$IMAGE" >/dev/null || die "podman run worker"

server="127.0.0.1:$(podman port kr-head 50051/tcp | sed 's/.*://')"
status="$("$REPO/.venv/bin/pagedserve" health --server "$server" --wait 300)" || die "health: $status"
out="$("$REPO/.venv/bin/pagedserve" client --server "$server" "def fib(n):" --max-tokens 16)" || die "generate"
[ "${#out}" -gt 11 ] || die "generate returned no text"
podman stop -t 60 kr-head >/dev/null 2>&1
code="$(podman inspect kr-head --format '{{.State.ExitCode}}')"
[ "$code" = 0 ] || die "the head exited $code after SIGTERM"
echo "[kuberay_smoke] OK: head (gateway, Ray without CPUs) + worker served $server: $status; generate: ${out//$'\n'/ }"
