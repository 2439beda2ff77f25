#!/usr/bin/env bash
# Runs the chart's KubeRay head and worker containers, as rendered, without a cluster: both in podman, the worker in
# the head's network namespace (one loopback, like a pod network), with the environment KubeRay gives them (the
# generated `ray start` in KUBERAY_GEN_RAY_START_CMD, RAY_ADDRESS, token auth) and KubeRay's wait-for-GCS step in
# between. As in the pods, the root filesystems are read-only and only the rendered emptyDirs (tmpfs here) and
# /dev/shm are writable. The head's Ray has no CPUs, so the engine can only run on the worker. Checks from the host:
# gRPC health SERVING (--grpc-port), HTTP GET /health 200 (--port), a generate call, and exit code 0 after SIGTERM
# to the head (the gateway drains, Ray stays up meanwhile).
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

# The RayCluster as the chart renders it (CPU, one worker group, the chart's default ports), and for each container
# the podman flags that give it its pod's settings: a read-only root, its emptyDirs (/dev/shm aside: --shm-size)
# and its environment.
"$PY" - "$REPO/deploy/helm/pagedserve" "$WORK" 2>"$WORK/render.err" <<'EOF' || { cat "$WORK/render.err" >&2; die "helm render"; }
import json, sys, helm_python as helm, yaml
values = {"mode": "kuberay", "kuberay": {"workerGroups": [{"name": "cpu", "replicas": 1}]}}
with helm.Chart.load(sys.argv[1]) as chart:
    rc = yaml.safe_load(chart.render(values, name="smoke", namespace="default")["pagedserve/templates/raycluster.yaml"])
head_pod = rc["spec"]["headGroupSpec"]["template"]["spec"]
worker_pod = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def podman_flags(pod):
    c = pod["containers"][0]
    flags = ["--read-only"] if c["securityContext"].get("readOnlyRootFilesystem") else []
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}
    # U: owned by the container's user, as an emptyDir is writable by the pod's.
    flags += [f"--tmpfs={m['mountPath']}:rw,exec,U" for m in c["volumeMounts"] if m["name"] in scratch]
    return flags + [f"--env={e['name']}={e['value']}" for e in c.get("env", []) if "value" in e]


def write(name, lines):
    open(f"{sys.argv[2]}/{name}", "w").write("".join(f"{x}\n" for x in lines))


head, worker = head_pod["containers"][0], worker_pod["containers"][0]
ports = {p["name"]: p["containerPort"] for p in head["ports"]}
json.dump(head["command"], open(f"{sys.argv[2]}/head_command", "w"))
json.dump(worker["command"], open(f"{sys.argv[2]}/worker_command", "w"))
write("head_args", head["args"])
write("head_flags", podman_flags(head_pod))
write("worker_flags", podman_flags(worker_pod))
write("head_ports", [ports["grpc"], ports["http"]])
EOF
mapfile -t head_args <"$WORK/head_args"
mapfile -t head_flags <"$WORK/head_flags"
mapfile -t worker_flags <"$WORK/worker_flags"
{ read -r grpc_port; read -r http_port; } <"$WORK/head_ports"
[ "${head_flags[0]}" = --read-only ] && [ "${worker_flags[0]}" = --read-only ] || die "the root filesystems are not read-only"
auth=(-e RAY_AUTH_MODE=token -e "RAY_AUTH_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')")

podman run -d --name kr-head --no-healthcheck -p "127.0.0.1::$grpc_port" -p "127.0.0.1::$http_port" --shm-size=1g \
    "${head_flags[@]}" "${auth[@]}" -e RAY_ADDRESS=127.0.0.1:6379 \
    -e "KUBERAY_GEN_RAY_START_CMD=ray start --head --num-cpus=0 --port=6379 --include-dashboard=false --block" \
    --entrypoint "$(cat "$WORK/head_command")" "$IMAGE" "${head_args[@]}" >/dev/null 2>"$WORK/podman.err" ||
    { cat "$WORK/podman.err" >&2; die "podman run head"; }
# KubeRay's wait-gcs-ready init container, which has the worker container's security context and mounts.
podman run --rm --no-healthcheck --network container:kr-head "${worker_flags[@]}" "${auth[@]}" --entrypoint bash \
    "$IMAGE" -c 'for _ in $(seq 90); do ray health-check --address 127.0.0.1:6379 >/dev/null 2>&1 && exit 0; sleep 2; done; exit 1' ||
    die "the head's GCS did not come up"
podman run -d --name kr-worker --no-healthcheck --network container:kr-head --shm-size=1g "${worker_flags[@]}" \
    "${auth[@]}" -e RAY_ADDRESS=127.0.0.1:6379 \
    -e "KUBERAY_GEN_RAY_START_CMD=ray start --address=127.0.0.1:6379 --num-cpus=2 --dashboard-agent-listen-port=52366 --block" \
    --entrypoint "$(cat "$WORK/worker_command")" "$IMAGE" >/dev/null || die "podman run worker"

server="127.0.0.1:$(podman port kr-head "$grpc_port/tcp" | sed 's/.*://')"
http="http://127.0.0.1:$(podman port kr-head "$http_port/tcp" | sed 's/.*://')"
status="$("$REPO/.venv/bin/pagedserve" health --server "$server" --wait 300)" || die "health: $status"
"$PY" -c 'import sys, urllib.request; sys.exit(urllib.request.urlopen(sys.argv[1] + "/health", timeout=10).status != 200)' \
    "$http" || die "GET /health on the HTTP API at $http"
out="$("$REPO/.venv/bin/pagedserve" client --server "$server" "def fib(n):" --max-tokens 16)" || die "generate"
[ "${#out}" -gt 11 ] || die "generate returned no text"
podman stop -t 60 kr-head >/dev/null 2>&1
code="$(podman inspect kr-head --format '{{.State.ExitCode}}')"
[ "$code" = 0 ] || die "the head exited $code after SIGTERM"
echo "[kuberay_smoke] OK: head (gateway, Ray without CPUs) + worker, read-only roots, served gRPC $server ($status)" \
    "and HTTP $http; generate: ${out//$'\n'/ }"
