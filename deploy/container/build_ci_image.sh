#!/usr/bin/env bash
# Builds pagedserve's CPU image from this checkout and proves it, on a Debian host with no container registry:
#   1. installs podman, buildah, runc and debootstrap (Debian packages) when missing;
#   2. makes the base image from a debootstrap --variant=minbase bookworm rootfs (podman import; kept in podman's
#      storage, so later runs skip this);
#   3. builds deploy/container/Containerfile with the CPU torch wheel that `pip download torch==2.13.0` resolves to
#      here, and the host's extra CA certificates as a build secret;
#   4. runs `pagedserve demo` in a container and checks that it prints completions and exits 0;
#   5. serves from a container with a read-only root filesystem, as the Helm chart runs it (writable: /tmp, /dev/shm,
#      $HOME as a tmpfs, the kernel cache volume), with published ports and, from the host, checks `pagedserve
#      health` on the gRPC port (SERVING), GET /health on the HTTP port, the image's HEALTHCHECK, /metrics and a
#      generate call; then stops it with SIGTERM while a stream runs and checks that the stream completes and the
#      container exits 0 within the drain timeout.
# Exits non-zero with a message at the first failure; removes its containers either way. Run as root (podman
# rootful; CI is root here) from anywhere:  bash deploy/container/build_ci_image.sh
# Environment: PAGEDSERVE (host CLI, default .venv/bin/pagedserve), TORCH_WHEEL (a CPU torch wheel to use instead
# of pip's pick), IMAGE (default localhost/pagedserve:ci), KEEP_IMAGES=0 (remove the built image at the end).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$REPO/deploy/container"
IMAGE="${IMAGE:-localhost/pagedserve:ci}"
BASE_IMAGE="localhost/pagedserve-ci-base:bookworm"
PAGEDSERVE="${PAGEDSERVE:-$REPO/.venv/bin/pagedserve}"
DRAIN_TIMEOUT=20
DEMO_CTR=pagedserve-ci-demo
SERVE_CTR=pagedserve-ci-serve
# A volume new in every run: the demo builds the CPU kernel into it at first start, the server reuses it.
KERNEL_CACHE=pagedserve-ci-torch-extensions
export CONTAINERS_CONF="$HERE/containers.conf"

WORK="$(mktemp -d)"
T0=$SECONDS
TIMINGS=()

log() { echo "[build_ci_image] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
timed() {  # timed LABEL CMD...: runs CMD and records how long it took
    local label=$1 t=$SECONDS; shift
    "$@"
    TIMINGS+=("$(printf '%-34s %4d s' "$label" $((SECONDS - t)))")
}
remove_containers() {
    local name
    for name in "$DEMO_CTR" "$SERVE_CTR"; do
        # Retried: right after a stop, podman's own exit cleanup can hold the container for a moment.
        for _ in 1 2 3 4 5; do
            podman container exists "$name" || break
            podman rm -f -t 0 "$name" >/dev/null 2>&1 || sleep 1
        done
    done
    podman volume rm -f "$KERNEL_CACHE" >/dev/null 2>&1 || true
}
cleanup() {
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        podman logs --tail 40 "$SERVE_CTR" 2>/dev/null | sed 's/^/[serve log] /' >&2 || true
    fi
    remove_containers
    [ "${KEEP_IMAGES:-1}" = 1 ] || podman rmi -f "$IMAGE" >/dev/null 2>&1 || true
    rm -rf "$WORK"
    if [ "${#TIMINGS[@]}" -gt 0 ]; then
        log "timings:"; printf '  %s\n' "${TIMINGS[@]}" >&2
        log "total $((SECONDS - T0)) s"
    fi
}
trap cleanup EXIT

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }

install_tools() {
    local need=()
    for tool in podman buildah runc debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
    [ "${#need[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "no apt-get: install podman, buildah, runc and debootstrap yourself"
    log "installing ${need[*]} (Debian packages)"
    # netavark + iptables: the network stack that publishes ports (containers-common would accept CNI instead).
    local pkgs=(podman buildah runc debootstrap netavark aardvark-dns iptables)
    apt_install() { as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}"; }
    # The package lists as they are first; refreshed only when that fails.
    { apt_install || { as_root apt-get update -q && apt_install; }; } >"$WORK/apt.log" 2>&1 ||
        { tail -20 "$WORK/apt.log" >&2; die "apt-get install ${pkgs[*]}"; }
}

make_base() {
    if podman image exists "$BASE_IMAGE"; then log "base image $BASE_IMAGE cached"; return 0; fi
    log "debootstrap bookworm (minbase)"
    local t=$SECONDS
    as_root debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
        { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap"; }
    TIMINGS+=("$(printf '%-34s %4d s' "debootstrap (minbase bookworm)" $((SECONDS - t)))")
    t=$SECONDS
    as_root tar -C "$WORK/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null ||
        die "podman import of the rootfs"
    as_root rm -rf "$WORK/rootfs"
    TIMINGS+=("$(printf '%-34s %4d s' "podman import" $((SECONDS - t)))")
}

torch_wheel() {  # prints the folder holding the CPU torch wheel
    mkdir -p "$WORK/torch-wheels"
    if [ -n "${TORCH_WHEEL:-}" ]; then
        cp "$TORCH_WHEEL" "$WORK/torch-wheels/"
    else
        # Where pip resolves torch==2.13.0 on this host (a local CPU wheel through pip's find-links, here).
        "$REPO/.venv/bin/pip" download -q --no-deps torch==2.13.0 -d "$WORK/torch-wheels" 2>"$WORK/pip.err" ||
            { cat "$WORK/pip.err" >&2; die "pip download torch==2.13.0"; }
    fi
    local whl; whl="$(ls "$WORK"/torch-wheels/torch-*.whl)"
    case "$whl" in
        *+cpu*) ;;
        *) die "torch resolved to $(basename "$whl"), not a CPU build; set TORCH_WHEEL=/path/to/torch-...+cpu-....whl" ;;
    esac
    echo "$WORK/torch-wheels"
}

build_image() {
    local wheels; wheels="$(torch_wheel)"
    local secret=()
    # The CA certificates update-ca-certificates adds on this host (a TLS-intercepting proxy's among them).
    cat /usr/local/share/ca-certificates/*.crt >"$WORK/extra_ca.pem" 2>/dev/null || true
    [ -s "$WORK/extra_ca.pem" ] && secret=(--secret "id=extra_ca,src=$WORK/extra_ca.pem")
    log "building $IMAGE (torch from $(basename "$(ls "$wheels"/*.whl)"))"
    podman build -f "$HERE/Containerfile" --ignorefile "$HERE/Containerfile.dockerignore" --format docker \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-context "torch-wheels=$wheels" "${secret[@]}" \
        -t "$IMAGE" "$REPO" >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; die "podman build"; }
    podman image prune -f >/dev/null  # earlier builds' images; the layers this one was built from stay as cache
    podman run --rm --no-healthcheck --entrypoint python "$IMAGE" -c \
        'import torch; assert torch.version.cuda is None, torch.__version__' || die "the image's torch is not the CPU build"
    [ "$(podman image inspect --format '{{.Config.User}}' "$IMAGE")" = "10001:10001" ] || die "the image does not run as user 10001"
}

run_demo() {
    podman run --name "$DEMO_CTR" --rm --no-healthcheck --shm-size=1g -v "$KERNEL_CACHE:/var/cache/pagedserve/torch_extensions" \
        "$IMAGE" demo >"$WORK/demo.log" 2>&1 || { tail -30 "$WORK/demo.log" >&2; die "pagedserve demo exited non-zero in the container"; }
    grep -E '^\[[0-3]\] ' "$WORK/demo.log" | head -8 >&2
    grep -qE '^\[4 requests, [1-9][0-9]* tokens' "$WORK/demo.log" || { cat "$WORK/demo.log" >&2; die "the demo printed no completions"; }
    if grep -q "CPU attention kernel unavailable" "$WORK/demo.log"; then
        grep "kernel unavailable" "$WORK/demo.log" >&2; die "the image could not build the CPU attention kernel"
    fi
}

host_port() { podman port "$SERVE_CTR" "$1/tcp" | head -1 | sed 's/.*://'; }

start_server() {
    # Ports published on the host's loopback only, each on a free port podman picks: the image's defaults, the HTTP
    # API on 8000 (--port) and gRPC on 50051 (--grpc-port), as `vllm serve`.
    # --read-only keeps /tmp and /dev/shm writable (tmpfs); $HOME is the chart's emptyDir (U: owned by the user).
    # Without systemd podman cannot time the HEALTHCHECK (it logs that on stderr); check_server runs it by hand.
    podman run -d --name "$SERVE_CTR" --shm-size=1g --read-only --tmpfs /home/pagedserve:rw,exec,U \
        -v "$KERNEL_CACHE:/var/cache/pagedserve/torch_extensions" \
        -p 127.0.0.1::50051 -p 127.0.0.1::8000 -p 127.0.0.1::9400 "$IMAGE" serve --host 0.0.0.0 \
        --drain-timeout "$DRAIN_TIMEOUT" >/dev/null 2>"$WORK/podman.err" ||
        { cat "$WORK/podman.err" >&2; die "podman run serve"; }
    GRPC="127.0.0.1:$(host_port 50051)"
    HTTP="127.0.0.1:$(host_port 8000)"
    METRICS="127.0.0.1:$(host_port 9400)"
    local status
    status="$("$PAGEDSERVE" health --server "$GRPC" --wait 300)" || die "health on $GRPC: $status after 300 s"
    log "health from the host on $GRPC: $status"
}

check_server() {
    local out prompt="def fib(n):"
    # The image's HEALTHCHECK command, run the way the engine runs it (no systemd timer is needed for this).
    podman healthcheck run "$SERVE_CTR" >/dev/null || die "the image's HEALTHCHECK failed on a serving container"
    out="$("$PAGEDSERVE" client --server "$GRPC" "$prompt" --max-tokens 16)" || die "generate over $GRPC"
    # The client prints the prompt and then the completion.
    [ "${#out}" -gt "${#prompt}" ] || die "generate returned no text: '$out'"
    log "generate from the host: $(echo "$out" | head -3 | tr '\n' ' ')"
    "$REPO/.venv/bin/python" - "$METRICS" <<'EOF' || die "/metrics on $METRICS has no pagedserve_ series"
import sys, urllib.request
body = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
sys.exit(0 if "pagedserve_generation_tokens_total" in body else 1)
EOF
    "$REPO/.venv/bin/python" -c 'import sys, urllib.request
sys.exit(urllib.request.urlopen(f"http://{sys.argv[1]}/health", timeout=10).status != 200)' "$HTTP" ||
        die "GET /health on the HTTP API ($HTTP)"
}

stop_server() {
    # A stream still running when SIGTERM arrives must finish (drain), then the container must exit 0.
    "$PAGEDSERVE" client --server "$GRPC" "class Stack:" --max-tokens 96 --ignore-eos --stream >"$WORK/drain.out" 2>&1 &
    local client=$! t
    sleep 1
    t=$SECONDS
    podman stop -t $((DRAIN_TIMEOUT + 30)) "$SERVE_CTR" >/dev/null 2>"$WORK/podman.err" ||
        { cat "$WORK/podman.err" >&2; die "podman stop"; }
    local took=$((SECONDS - t)) code
    code="$(podman inspect --format '{{.State.ExitCode}}' "$SERVE_CTR")"
    wait "$client" || { cat "$WORK/drain.out" >&2; die "the stream in flight at SIGTERM failed instead of draining"; }
    [ "$(wc -c <"$WORK/drain.out")" -gt 40 ] || { cat "$WORK/drain.out" >&2; die "the draining stream returned no text"; }
    [ "$code" = 0 ] || die "the server exited $code after SIGTERM (want 0)"
    [ "$took" -le $((DRAIN_TIMEOUT + 10)) ] || die "the server took ${took} s to stop (drain timeout ${DRAIN_TIMEOUT} s)"
    log "SIGTERM: the running stream finished, exit code 0 after ${took} s"
}

cd "$REPO"
[ -x "$PAGEDSERVE" ] || die "no host CLI at $PAGEDSERVE (run .ci/install first, or set PAGEDSERVE)"
timed "install podman/buildah/debootstrap" install_tools
remove_containers  # left over by a run that was killed
make_base
timed "podman build" build_image
timed "pagedserve demo in a container" run_demo
timed "serve: start until SERVING" start_server
timed "serve: health, generate, metrics" check_server
timed "serve: SIGTERM drain" stop_server
log "OK: $IMAGE builds, runs the demo and serves"
