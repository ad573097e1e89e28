#!/usr/bin/env bash
# The OCI image (issue 32): build it, look at it.
#
#   scripts/image.sh build lite|full [--arch amd64|arm64]  # localhost/edge-appliance:lite (LiteRT only) or :full (+ TensorFlow, + the llm extra)
#   scripts/image.sh base [--arch A]                       # only the Debian base images (cached)
#   scripts/image.sh layers [IMAGE]                        # size, largest layers and what made each
#   scripts/image.sh podman-args                           # the `podman run` options this machine needs (see below)
#
# An image for another architecture than this machine's is tagged with it (:lite-arm64); it
# builds without emulation (deploy/Containerfile: the builder runs natively, the runtime stage
# only copies). scripts/arm64-check.sh --image runs it under qemu.
#
# The engine: podman (Debian's podman + runc are installed when missing and this runs as root),
# else docker when its engine answers. Images are built in the docker format: podman keeps a
# HEALTHCHECK only there.
#
# The base: EDGE_IMAGE_BASE=debian (the default where apt-get exists) builds Python 3.11 base
# images from Debian bookworm's own packages with mmdebstrap and imports them
# (localhost/edge-appliance-base, -builder), so no image registry is needed; =official uses
# docker.io/library/python:3.11-slim-bookworm, as deploy/Containerfile does by itself (written,
# not built by the tests: they run where no registry answers, on the debian base).
#
# Caches, all outside the checkout so that a CI run on a clean checkout of the same machine
# reuses them: the base images (tagged by a hash of their recipe; rebuilt when it changes, or
# with EDGE_IMAGE_REFRESH_BASE=1 for Debian's security updates), the engine's layer cache (the
# build context is staged with fixed file times, so a layer's key depends on content alone:
# a code change rebuilds only the project's layer) and pip's download cache (a build cache
# mount). This host's pip configuration (indexes, find-links, certificate) is given to the
# builder's RUN steps read-only, as scripts/arm64-check.sh gives it to its chroot.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPO=localhost/edge-appliance
SUITE=bookworm
CLEANUP=()
trap 'rm -rf "${CLEANUP[@]}"' EXIT

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
usage() { sed -n '2,8s/^# \{0,1\}//p' "$0" >&2; exit 2; }

host_arch() { case "$(uname -m)" in x86_64) echo amd64;; aarch64|arm64) echo arm64;; *) uname -m;; esac; }

# --- the engine ------------------------------------------------------------------------------
engine() {
  if [ -n "${EDGE_IMAGE_ENGINE:-}" ]; then echo "$EDGE_IMAGE_ENGINE"; return; fi
  if command -v podman >/dev/null; then echo podman; return; fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing podman and runc from Debian's packages"
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman runc conmon catatonit containernetworking-plugins uidmap >/dev/null || die "apt-get install podman"
    echo podman; return
  fi
  die "no container engine: install podman (Debian: apt-get install podman runc) or start docker's engine"
}

# `podman run`/`podman build` options for limits: a container's rlimits may not exceed this
# process's hard limits without CAP_SYS_RESOURCE, which a sandbox (or an unprivileged CI
# runner) lacks, while podman's defaults ask for 1048576 open files. Printed empty where the
# defaults fit. (A sandbox's kernel may also refuse an RLIMIT_NPROC above pid_max: capped there.)
limit_args() {
  local n u pid_max
  n=$(ulimit -Hn); u=$(ulimit -Hu); pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo unlimited)
  if [ "$pid_max" != unlimited ] && { [ "$u" = unlimited ] || [ "$u" -gt "$pid_max" ]; }; then u=$pid_max; fi
  if [ "$n" != unlimited ] && [ "$n" -lt 1048576 ]; then printf -- '--ulimit nofile=%s:%s ' "$n" "$n"; fi
  if [ "$u" != unlimited ] && [ "$u" -lt 4194304 ]; then printf -- '--ulimit nproc=%s:%s ' "$u" "$u"; fi
}

# --- the Debian base images --------------------------------------------------------------------
debian_mirror() {  # this host's own Debian mirror (its apt sources); else deb.debian.org
  local found
  found=$({ sed -n 's/^URIs: *\([^ ]*\/debian\)\/*$/\1/p' /etc/apt/sources.list.d/*.sources
            awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2}' /etc/apt/sources.list; } 2>/dev/null || true)
  found=${found%%$'\n'*}
  echo "${found:-http://deb.debian.org/debian}"
}
# What each base holds. runtime: Python 3.11 and what the wheels need from the system (libstdc++
# for grpcio and LiteRT, CA certificates for https/S3 buckets, time zones, libnghttp2 for the lean
# gRPC server: without it gRPC falls back to grpcio, a problem on the page), no pip, no apt.
# builder: the same with pip and venv, and binutils for both architectures (deploy/prune_site.py strips
# debug sections). Both: no documentation, manuals or locales, and perl
# (pulled in by usrmerge only) purged.
RUNTIME_PKGS=usr-is-merged,python3,ca-certificates,libstdc++6,tzdata,libnghttp2-14
BUILDER_PKGS=$RUNTIME_PKGS,python3-pip,python3-venv,binutils,binutils-x86-64-linux-gnu,binutils-aarch64-linux-gnu
PURGE="usrmerge libfile-find-rule-perl libnumber-compare-perl libtext-glob-perl perl libperl5.36 perl-modules-5.36 libgdbm-compat4"
base_tag() {  # base_tag runtime|builder ARCH: the tag, keyed by the recipe (this function and the lists above)
  local pkgs=$RUNTIME_PKGS; [ "$1" = builder ] && pkgs=$BUILDER_PKGS
  echo "localhost/edge-appliance-$1:$SUITE-$2-$(echo "$SUITE $pkgs $PURGE v1" | sha256sum | cut -c1-10)"
}
build_base() {  # build_base runtime|builder ARCH
  local kind=$1 arch=$2 tag pkgs mirror out
  tag=$(base_tag "$kind" "$arch")
  if [ "${EDGE_IMAGE_REFRESH_BASE:-0}" != 1 ] && "$ENGINE" image exists "$tag" 2>/dev/null; then echo "$tag"; return; fi
  local need=()
  command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
  [ "$arch" = "$(host_arch)" ] || command -v arch-test >/dev/null || need+=(arch-test)  # mmdebstrap's check of a foreign arch
  if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing ${need[*]}: apt-get install ${need[*]} (or EDGE_IMAGE_BASE=official)"
    log "installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
      || die "apt-get install ${need[*]}"
  fi
  pkgs=$RUNTIME_PKGS; [ "$kind" = builder ] && pkgs=$BUILDER_PKGS
  mirror=$(debian_mirror)
  out=$(mktemp -d)
  log "mmdebstrap $SUITE $arch ($kind: ${pkgs//,/ }) from $mirror"
  local cmd=(mmdebstrap --variant=essential --arch="$arch" --include="$pkgs"
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --customize-hook="chroot \"\$1\" dpkg --purge $PURGE"
    "$SUITE" "$out/rootfs.tar"
    "deb $mirror $SUITE main" "deb $mirror $SUITE-updates main" "deb ${mirror%/debian}/debian-security $SUITE-security main")
  if [ "$arch" = "$(host_arch)" ]; then
    "${cmd[@]}" > "$out/mmdebstrap.log" 2>&1 || { tail -20 "$out/mmdebstrap.log" >&2; die "mmdebstrap ($kind, $arch)"; }
  else  # a foreign userland's maintainer scripts run under qemu (scripts/emulate-aarch64.sh)
    "$ROOT/scripts/emulate-aarch64.sh" "${cmd[@]}" > "$out/mmdebstrap.log" 2>&1 \
      || { tail -20 "$out/mmdebstrap.log" >&2; die "mmdebstrap ($kind, $arch) under emulation"; }
  fi
  "$ENGINE" import --arch "$arch" --change 'CMD ["/usr/bin/python3"]' --change 'ENV LANG=C.UTF-8' \
    "$out/rootfs.tar" "$tag" >/dev/null || die "$ENGINE import of the $kind base"
  rm -rf "$out"
  log "base image $tag: $("$ENGINE" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
  echo "$tag"
}

# --- the build context: what .dockerignore lets in, with fixed file times ----------------------
stage_context() {  # stage_context DIR
  local dir=$1
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md appliance runtimes sync ui \
      deploy/requirements_from_pyproject.py deploy/prune_site.py \
    | xargs -0 tar -c --ignore-failed-read -f - 2>/dev/null) | tar -x -C "$dir"
  cp "$ROOT/.dockerignore" "$dir/"
  find "$dir" -exec touch -h -d @0 {} +  # a layer's cache key: content, never checkout times
}

# --- this host's pip configuration, for the builder's RUN steps ---------------------------------
pip_volumes() {  # prints -v options; writes the pip.conf they mount into $1
  local conf=$1 pipconf p
  pipconf=$(python3 -m pip config list 2>/dev/null || true)
  [ -n "$pipconf" ] || return 0
  { echo "# this host's \`pip config list\`, for the image's builder (scripts/image.sh)"; echo "[global]"
    printf '%s\n' "$pipconf" | sed -n "s/^[^.]*\.\([a-z-]*\)='\(.*\)'$/\1 = \2/p" | awk '!seen[$1]++'; } > "$conf"
  printf -- '-v %s:/etc/pip.conf:ro ' "$conf"
  printf '%s\n' "$pipconf" | sed -n "s/^[^=]*='\(.*\)'$/\1/p" | tr ' ' '\n' | sed 's#^file://##; s#/simple/*$##' \
    | grep '^/' | sort -u | while IFS= read -r p; do [ -e "$p" ] && printf -- '-v %s:%s:ro ' "$p" "$p"; done
  return 0
}

# --- build -------------------------------------------------------------------------------------
cmd_build() {
  local flavor=${1:-} arch extras tag ctx base builder t0 version revision source pipconf
  shift || true
  arch=$(host_arch)
  while [ $# -gt 0 ]; do
    case "$1" in
      --arch) arch=${2:?--arch needs amd64 or arm64}; shift 2;;
      --arch=*) arch=${1#--arch=}; shift;;
      *) usage;;
    esac
  done
  case "$flavor" in lite) extras=tflite;; full) extras=tf,tflite,llm;; *) usage;; esac
  case "$arch" in amd64|x86_64) arch=amd64;; arm64|aarch64) arch=arm64;; *) die "unsupported --arch $arch (amd64 or arm64)";; esac
  tag=$REPO:$flavor; [ "$arch" = "$(host_arch)" ] || tag=$REPO:$flavor-$arch
  base=docker.io/library/python:3.11-slim-bookworm; builder=$base
  local pull=()
  if [ "${EDGE_IMAGE_BASE:-$(command -v apt-get >/dev/null && echo debian || echo official)}" = debian ]; then
    base=$(build_base runtime "$arch"); builder=$(build_base builder "$(host_arch)")
    pull=(--pull=never)  # local images; podman 4.3 would look for an arm64 builder, not $BUILDPLATFORM's
  fi
  ctx=$(mktemp -d); pipconf=$(mktemp)
  CLEANUP+=("$ctx" "$pipconf")
  stage_context "$ctx"
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -n1)
  revision=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
  [ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] || revision="$revision-dirty"
  source=$(git -C "$ROOT" remote get-url origin 2>/dev/null || echo unknown)
  local args=(build "${pull[@]}" --layers --network host -f "$ROOT/deploy/Containerfile" -t "$tag" --platform "linux/$arch"
    --build-arg "BASE_IMAGE=$base" --build-arg "BUILDER_IMAGE=$builder" --build-arg "EXTRAS=$extras"
    --build-arg "BUILDPLATFORM=linux/$(host_arch)" --build-arg "FLAVOR=$flavor" --build-arg "VERSION=$version" --build-arg "REVISION=$revision"
    --build-arg "SOURCE=$source" --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
  # shellcheck disable=SC2207
  [ "$ENGINE" = podman ] && args+=(--format docker $(limit_args) $(pip_volumes "$pipconf"))
  log "$ENGINE build $tag (extras $extras, linux/$arch, base $base)"; [ -z "${EDGE_IMAGE_DEBUG:-}" ] || log "$ENGINE ${args[*]}"
  t0=$(date +%s.%N)
  "$ENGINE" "${args[@]}" "$ctx" >&2 || die "$ENGINE build $tag"
  log "built $tag in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}') s: $(image_size "$tag") MB"
  echo "$tag"
}

image_size() { "$ENGINE" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f", $1/1e6}'; }

cmd_layers() {  # the image's layers, largest first, with the step that made each
  local tag=${1:-$REPO:lite}
  echo "$tag: $(image_size "$tag") MB, $("$ENGINE" image inspect --format '{{.Os}}/{{.Architecture}}' "$tag")"
  "$ENGINE" history --no-trunc --format json "$tag" | python3 -c '
import json, sys
for layer in sorted(json.load(sys.stdin), key=lambda l: -(l.get("size") or 0)):
    by = (layer.get("createdBy") or layer.get("CreatedBy") or "")[:200]
    if layer.get("size"):
        print("%8.1f MB  %s" % (layer["size"] / 1e6, by))' 
}

[ $# -ge 1 ] || usage
what=$1; shift
case "$what" in
  podman-args) limit_args; echo; exit 0;;
esac
ENGINE=$(engine)
case "$what" in
  build) cmd_build "$@";;
  base) a=$(host_arch); [ "${1:-}" = --arch ] && a=${2:?}; build_base runtime "$a"; build_base builder "$(host_arch)";;
  layers) cmd_layers "$@";;
  *) usage;;
esac
