#!/usr/bin/env bash
# The LiteRT-only install, served and tested on aarch64 under emulation (issue 27).
#
#   scripts/arm64-check.sh             # as root on a Debian x86-64 host
#   scripts/arm64-check.sh --record    # ... and append the figures to bench/RESULTS.md
#   scripts/arm64-check.sh --image [--record]  # the arm64 OCI image (scripts/image.sh), its smoke run in podman
#   ARM64=1 scripts/test.sh            # the x86-64 suite, then this
#
# 1. An aarch64 Debian bookworm userland (Python 3.11) built with Debian's own tools:
#    `debootstrap --foreign --arch=arm64`, then its second stage run under qemu-user.
#    Cached under $ARM64_CACHE (default /var/cache/edge-appliance-arm64): reruns skip it.
# 2. aarch64 binaries run through binfmt_misc, registered in a private user namespace (a
#    binfmt_misc instance of its own, kernel 6.7+): nothing is registered on the host, and
#    every mount made below vanishes with the namespace, even if this script is killed.
#    The emulator is qemu-user 9 or newer (see choose_qemu: 7.2 crashes inside LiteRT 2.x).
# 3. In the chroot, as a device would: a fresh venv and `pip install '.[tflite]'` of this
#    working tree from the registry, with this host's pip configuration (find-links, extra
#    indexes, certificate, constraints) copied in and the local folders it names bind-mounted
#    read-only at the same paths. pip's download cache is kept in $ARM64_CACHE. Twice: as
#    resolved (2.x on bookworm) and with ai-edge-litert==1.4.0 (what an aarch64 device with
#    glibc < 2.27 gets); ARM64_LITERT="resolved" (or "1.4.0") runs one.
# 4. scripts/arm64_smoke.py runs in the chroot with that venv's Python: probe, the embedded
#    default and a TFLite model folder over REST, TF Serving gRPC and KServe v2 gRPC, a hot
#    swap from a folder bucket, /readyz, /api/status, cold start and idle RSS. Its test
#    models are built here first with the x86-64 .venv's TensorFlow (tests/support/modelgen.py).
#
# Emulated times are not device times: qemu-user runs aarch64 code several times slower.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${ARM64_CACHE:-/var/cache/edge-appliance-arm64}
SUITE=bookworm
INCLUDE=python3,python3-venv,ca-certificates
ROOTFS=$CACHE/rootfs-$SUITE
DEV=/opt/edge-appliance   # inside the chroot: src/, venv/, models/, out/

log() { printf '[arm64-check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

# --- inside the private user + mount namespace (see run_in_namespace) -----------------------
if [ "${_ARM64_IN_NS:-}" = 1 ]; then
  # Register qemu-aarch64 in this namespace's own binfmt_misc instance. F: the kernel opens
  # the emulator now, so it need not be reachable inside the chroot. The \x escapes are the
  # kernel's to decode: printed as they stand (printf %b would cut the magic at \x00).
  bfm=$(mktemp -d)
  mount -t binfmt_misc binfmt_misc "$bfm" || die "cannot mount a private binfmt_misc (kernel 6.7+ needed)"
  printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$_ARM64_QEMU"':FC' \
    > "$bfm/register"
  target=$1; shift
  for d in proc sys dev; do mount --rbind "/$d" "$target/$d"; done
  # Bind the local paths the pip configuration names (read-only, same path inside).
  while IFS= read -r p; do
    [ -n "$p" ] || continue
    if [ -d "$p" ]; then mkdir -p "$target$p"; else mkdir -p "$(dirname "$target$p")"; touch "$target$p"; fi
    mount --bind "$p" "$target$p" && mount -o remount,bind,ro "$target$p"
  done < "${_ARM64_BINDS:-/dev/null}"
  if [ -n "${_ARM64_PIP_CACHE:-}" ]; then
    mkdir -p "$target/root/.cache/pip"; mount --bind "$_ARM64_PIP_CACHE" "$target/root/.cache/pip"
  fi
  [ "$(chroot "$target" /usr/bin/uname -m)" = aarch64 ] || die "binfmt emulation is not active in the chroot"
  exec chroot "$target" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin "$@"
fi

# Run "$@" (this script, re-entered) in a new user + mount namespace whose uids and gids
# 0-65535 are the host's own: root stays root, files keep their owners, but binfmt_misc
# and the mounts are private to it.
run_in_namespace() {
  local fifo pid me i
  fifo=$(mktemp -u); mkfifo "$fifo"
  unshare --user --mount --propagation private -- sh -c 'read go < "$0"; shift; exec "$@"' "$fifo" x "$@" &
  pid=$!
  me=$(readlink /proc/self/ns/user)
  for i in $(seq 200); do
    [ "$(readlink "/proc/$pid/ns/user" 2>/dev/null)" != "$me" ] && break
    sleep 0.05
  done
  [ "$(readlink "/proc/$pid/ns/user" 2>/dev/null)" != "$me" ] || { kill "$pid"; die "unshare did not enter a user namespace within 10 s"; }
  echo "0 0 65536" > "/proc/$pid/uid_map"
  echo "0 0 65536" > "/proc/$pid/gid_map"
  echo go > "$fifo"; rm -f "$fifo"
  wait "$pid"
}

in_chroot() {  # in_chroot CMD... : run CMD in the aarch64 userland
  _ARM64_IN_NS=1 run_in_namespace env _ARM64_IN_NS=1 _ARM64_QEMU="$QEMU" _ARM64_BINDS="${BINDS:-}" _ARM64_PIP_CACHE="${PIP_CACHE:-}" \
    bash "$ROOT/scripts/arm64-check.sh" "$ROOTFS" "$@"
}

# --- the emulator ----------------------------------------------------------------------------
# qemu-user 7.2 (bookworm's qemu-user-static) crashes (SIGSEGV) inside LiteRT 2.3's XNNPACK
# delegate; qemu 10 runs it. Use the host's qemu-aarch64-static when it is 9 or newer, else take
# qemu-user from Debian's bookworm-backports into $CACHE with a private apt state (apt-get
# download: nothing is installed on the host).
qemu_major() { "$1" --version 2>/dev/null | sed -n '1s/^qemu-aarch64 version \([0-9]*\).*/\1/p'; }
choose_qemu() {
  local q d a mirror
  # static builds only: binfmt's F flag opens the file now, but a dynamic one would look for
  # its libraries inside the chroot
  for q in "${ARM64_QEMU:-}" /usr/bin/qemu-aarch64-static "$CACHE/qemu/usr/bin/qemu-aarch64"; do
    [ -n "$q" ] && [ -x "$q" ] && [ "$(qemu_major "$q")" -ge 9 ] 2>/dev/null && { echo "$q"; return; }
  done
  d=$CACHE/apt-backports; rm -rf "$d" "$CACHE/qemu"; mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  mirror=$(debian_mirror); [ -n "$mirror" ] || die "no Debian mirror in the host's apt sources for qemu-user"
  echo "deb $mirror bookworm-backports main" > "$d/sources.list"
  a=(-o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$d/lists"
     -o "Dir::Cache=$d/cache" -o APT::Sandbox::User=root)
  apt-get "${a[@]}" update -qq >&2 || die "apt-get update of bookworm-backports (for qemu-user)"
  (cd "$d" && apt-get "${a[@]}" download -qq qemu-user/bookworm-backports >&2) || die "apt-get download qemu-user"
  dpkg-deb -x "$d"/qemu-user_*.deb "$CACHE/qemu"
  [ "$(qemu_major "$CACHE/qemu/usr/bin/qemu-aarch64")" -ge 9 ] || die "qemu-user from bookworm-backports is older than 9"
  echo "$CACHE/qemu/usr/bin/qemu-aarch64"
}
debian_mirror() {  # the host's own Debian mirror (its apt sources); empty: debootstrap's default
  sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1
  awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true
}

# --- this host's pip configuration, for the chroot ------------------------------------------
# `pip config list` shows every file and PIP_* variable; a device with the same registry
# access gets the same resolution. Local paths it names are bind-mounted read-only (for a
# local index .../simple, the folder above it: its pages link to ../../files/).
pip_config() {
  local hostpy pipconf
  hostpy=$(command -v python3)
  pipconf=$("$hostpy" -m pip config list 2>/dev/null || true)
  {
    echo "# written by scripts/arm64-check.sh from the host's \`pip config list\`"
    echo "[global]"
    printf '%s\n' "$pipconf" | sed -n "s/^[^.]*\.\([a-z-]*\)='\(.*\)'$/\1 = \2/p" | awk '!seen[$1]++'  # PIP_* variables come first and win, as in pip
  } > "$ROOTFS/etc/pip.conf"
  printf '%s\n' "$pipconf" | sed -n "s/^[^=]*='\(.*\)'$/\1/p" | tr ' ' '\n' | sed 's#^file://##; s#/simple/*$##' \
    | grep '^/' | while IFS= read -r p; do [ -e "$p" ] && echo "$p"; done | sort -u > "$BINDS"
  cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
  cp /etc/hosts "$ROOTFS/etc/hosts" 2>/dev/null || true
}

smoke_models() {  # sets $models: the smoke suite's models, built on the host with TensorFlow (cached)
  hostvenv=${PYTHON:-$ROOT/.venv/bin/python}
  if ! "$hostvenv" -c 'import tensorflow' 2>/dev/null; then
    log "no TensorFlow in $hostvenv: setting up .venv with the tf,tflite extras"
    "$ROOT/scripts/setup-venv.sh" tf,tflite
    hostvenv=$ROOT/.venv/bin/python
  fi
  # the key: what builds the models (a file missing here is a moved file: stop, do not hash nothing)
  models_key=$( { cat "$ROOT/tests/support/modelgen.py" && sed -n '/^def prepare/,/^# ---/p' "$ROOT/scripts/arm64_smoke.py"; } \
    | sha256sum | cut -c1-12) || { log "cannot read the model builders to key the cache"; exit 1; }
  models=$CACHE/models-$models_key
  if [ ! -f "$models/.complete" ]; then
    log "building the smoke models with $hostvenv"
    rm -rf "$models.tmp"
    (cd "$ROOT" && "$hostvenv" scripts/arm64_smoke.py prepare "$models.tmp") > "$CACHE/prepare.log" 2>&1 \
      || { tail -30 "$CACHE/prepare.log" >&2; die "building the smoke models"; }
    touch "$models.tmp/.complete"; rm -rf "$models"; mv "$models.tmp" "$models"
  fi
}

# --- --image: the arm64 OCI image (issue 32), its smoke run under emulation -------------------
# scripts/image.sh builds localhost/edge-appliance:lite-arm64 without emulation (its runtime
# stage only copies); here podman runs it in scripts/emulate-aarch64.sh's private namespace
# (qemu registered there only), with no network (a network namespace of its own: the smoke
# suite talks to the service on the container's own loopback), as uid 10001, and
# scripts/arm64_smoke.py device runs inside with the image's own Python and `appliance`.
image_check() {
  local tag out t0 build_s smoke_s
  mkdir -p "$CACHE"
  QEMU=$(choose_qemu)
  log "emulator: $("$QEMU" --version | head -n1)"
  smoke_models
  t0=$(date +%s.%N)
  tag=$("$ROOT/scripts/image.sh" build lite --arch arm64) || die "scripts/image.sh build lite --arch arm64"
  build_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
  out=$(mktemp -d); chmod 0777 "$out"
  log "smoke suite in $tag under emulation (podman run --network none, scripts/arm64_smoke.py device)"
  t0=$(date +%s.%N)
  # shellcheck disable=SC2046
  ARM64_QEMU=$QEMU "$ROOT/scripts/emulate-aarch64.sh" podman run --rm --network none \
    $("$ROOT/scripts/image.sh" podman-args) -v "$models:/smoke/models:ro" -v "$out:/smoke/out" \
    -v "$ROOT/scripts/arm64_smoke.py:/smoke/arm64_smoke.py:ro" --entrypoint /opt/edge-appliance/venv/bin/python \
    "$tag" /smoke/arm64_smoke.py device /smoke/models /smoke/out/results.json \
    || die "the aarch64 smoke suite in $tag (see above)"
  smoke_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
  "$(command -v python3)" - "$out/results.json" "$QEMU" "$tag" "$build_s" "$smoke_s" "$(( $(date +%s) - t_start ))" \
    "$record" "$ROOT/bench/RESULTS.md" "$("$ROOT/scripts/image.sh" layers "$tag" | head -n1)" <<'PY'
import json, os, platform, subprocess, sys, time
results, qemu, tag, build_s, smoke_s, wall_s, record, results_md, size_line = sys.argv[1:]
r = json.load(open(results))
qemu_v = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
rows = [
    ("image", f"`{tag}`: {size_line.split(': ', 1)[1]}"),
    ("LiteRT in the image", r["litert"]),
    ("`scripts/image.sh build lite --arch arm64`, s (no emulation: the runtime stage only copies; layers cached)", build_s),
    ("smoke suite in the container, s", smoke_s),
    ("first start to /readyz 200, s (embedded default: publish, sync, select, load)", r["first_start_s"]),
    (f"cold start to /readyz 200, s (restart, decision cached; median of {len(r['restarts_s'])})", r["cold_start_s"]),
    ("RSS idle, MB: embedded default (half_plus_two)", r["rss_idle_mb"]),
    ("hot swap: `appliance publish` of v2 to v2 answering, s",
     f"{r['swap_s']} ({r['swap_requests']} requests across it: {r['swap_answers']['v1']} answered by v1, "
     f"{r['swap_answers']['v2']} by v2, none failed)"),
]
lines = [
    f"\n## The arm64 OCI image under emulation, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
    f"Host: {platform.machine()}, {os.cpu_count()} CPUs, shared (load average {os.getloadavg()[0]:.1f} at the end). "
    f"The image built by `scripts/image.sh build lite --arch arm64`, run by podman with {qemu_v} registered in a "
    f"private binfmt_misc (scripts/emulate-aarch64.sh), `--network none`, as uid 10001; scripts/arm64_smoke.py "
    f"device ran inside with the image's Python. Command: `scripts/arm64-check.sh --image --record`, {wall_s} s "
    "wall time in all. **Emulated times are not device times** (see \"aarch64 under emulation\" above).\n",
    "| figure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows],
]
text = "\n".join(lines) + "\n"
print(text)
if record == "1":
    with open(results_md, "a") as f:
        f.write(text)
PY
  rm -rf "$out"
  log "PASSED in $(( $(date +%s) - t_start )) s"
}

record=0 image=0
while [ $# -gt 0 ]; do
  case "$1" in --record) record=1; shift;; --image) image=1; shift;; *) break;; esac
done
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and namespaces need it)"
BINDS=$(mktemp); PIP_CACHE=$CACHE/pip-cache
trap 'rm -f "$BINDS"' EXIT
if [ "${1:-}" = --run ]; then  # --run CMD...: run CMD in the cached userland (to look around)
  shift; [ -d "$ROOTFS/etc" ] || die "no cached userland in $ROOTFS: run the check once first"
  QEMU=$(choose_qemu); pip_config; in_chroot "$@"; exit
fi
[ "$(uname -m)" = x86_64 ] || log "host is $(uname -m), not x86_64: this still emulates aarch64"
t_start=$(date +%s)
if [ "$image" = 1 ]; then image_check; exit; fi

need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v unshare >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
mkdir -p "$CACHE" "$PIP_CACHE"
QEMU=$(choose_qemu)
log "emulator: $("$QEMU" --version | head -n1)"

# --- 1. the aarch64 userland, cached ------------------------------------------------------
stamp="$ROOTFS/.complete-$(echo "$SUITE $INCLUDE" | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  mirror=$(debian_mirror | head -n1)
  rm -rf "$ROOTFS"
  log "debootstrap --foreign --arch=arm64 $SUITE (first stage; mirror: the host's apt sources)"
  debootstrap --foreign --arch=arm64 --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" ${mirror:+"$mirror"} \
    > "$CACHE/debootstrap-1.log" 2>&1 || { tail -20 "$CACHE/debootstrap-1.log" >&2; die "debootstrap first stage"; }
  log "debootstrap --second-stage under qemu-aarch64 (several minutes)"
  # container=lxc: debootstrap's own switch for a user namespace, where mknod is not allowed
  # (the device nodes are the host's /dev, bound in).
  in_chroot env container=lxc /debootstrap/debootstrap --second-stage > "$CACHE/debootstrap-2.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap-2.log" >&2; die "debootstrap second stage"; }
  touch "$stamp"
fi
pip_config
log "pip config for the chroot: $(grep -c ' = ' "$ROOTFS/etc/pip.conf") settings, $(wc -l < "$BINDS") local paths bound"
in_chroot python3 -c 'import platform, sys; assert platform.machine() == "aarch64", platform.machine(); print(sys.version)' \
  || die "python3 in the chroot is not an aarch64 Python"

# --- 2. test models, built on the host with TensorFlow -------------------------------------
smoke_models
rm -rf "$ROOTFS$DEV"; mkdir -p "$ROOTFS$DEV/src" "$ROOTFS$DEV/out"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -c --ignore-failed-read -f - 2>/dev/null) \
  | tar -x -C "$ROOTFS$DEV/src"
cp -a "$models" "$ROOTFS$DEV/models"

# --- 3. per LiteRT release: the device install, then the smoke suite -----------------------
# "resolved": `pip install '.[tflite]'` as it stands (bookworm's glibc 2.36 takes the newest
# manylinux_2_27 wheel); "1.4.0": the same plus ai-edge-litert==1.4.0, the newest release with
# a manylinux_2_17 aarch64 wheel: what an aarch64 device with glibc older than 2.27 gets.
variants=${ARM64_LITERT:-resolved 1.4.0}
summary=()
for variant in $variants; do
  venv=$DEV/venv-$variant
  pin=""; [ "$variant" = resolved ] || pin="ai-edge-litert==$variant"
  src_copy=$DEV/src-$variant  # a build writes into its source tree: one copy per install
  cp -a "$ROOTFS$DEV/src" "$ROOTFS$src_copy"
  log "[$variant] pip install '.[tflite]'${pin:+ $pin} in a fresh venv under emulation"
  t0=$(date +%s.%N)
  in_chroot sh -c "cd $src_copy && python3 -m venv $venv && $venv/bin/python -m pip install -q '.[tflite]' $pin" \
    > "$CACHE/install-$variant.log" 2>&1 \
    || { grep -v '^WARNING: Location' "$CACHE/install-$variant.log" | tail -30 >&2; die "[$variant] pip install '.[tflite]' on aarch64"; }
  install_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
  rm -rf "$ROOTFS$src_copy"
  install_kb=$(du -sk "$ROOTFS$venv" | cut -f1)
  in_chroot "$venv/bin/python" -m pip list --format=freeze > "$ROOTFS$DEV/out/freeze-$variant.txt" 2>/dev/null
  log "[$variant] installed in $install_s s, $((install_kb / 1024)) MB: $(grep -i -E '^(ai-edge-litert|numpy|grpcio|protobuf)==' "$ROOTFS$DEV/out/freeze-$variant.txt" | tr '\n' ' ')"
  if in_chroot "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("tensorflow") is None)'; then
    die "[$variant] the LiteRT-only install brought TensorFlow"
  fi
  log "[$variant] smoke suite under emulation (scripts/arm64_smoke.py device)"
  t0=$(date +%s.%N)
  in_chroot sh -c "cd / && $venv/bin/python $DEV/src/scripts/arm64_smoke.py device $DEV/models $DEV/out/results-$variant.json" \
    || die "[$variant] the aarch64 smoke suite (see above)"
  smoke_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
  summary+=("$variant $install_s $install_kb $smoke_s")
done
wall_s=$(( $(date +%s) - t_start ))

"$(command -v python3)" - "$ROOTFS$DEV/out" "$QEMU" "$wall_s" "$record" "$ROOT/bench/RESULTS.md" "${summary[@]}" <<'PY'
import json, os, platform, subprocess, sys, time
out, qemu, wall_s, record, results_md, *runs = sys.argv[1:]
qemu_v = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
cols, rows = [], {}
for run in runs:
    variant, install_s, install_kb, smoke_s = run.split()
    r = json.load(open(f"{out}/results-{variant}.json"))
    freeze = open(f"{out}/freeze-{variant}.txt").read().split()
    pkgs = [p for p in freeze if not p.startswith(("pip==", "setuptools=="))]
    cols.append(f"{r['litert']} ({'as resolved' if variant == 'resolved' else 'pinned'})")
    for key, value in [
        ("packages installed (grpcio, numpy, protobuf)", f"{len(pkgs)} (" + ", ".join(
            p.split("==")[1] for p in freeze if p.split("==")[0].lower() in ("numpy", "grpcio", "protobuf")) + ")"),
        ("`pip install '.[tflite]'` into a fresh venv, s (pip download cache warm)", install_s),
        ("venv size on disk, MB", f"{int(install_kb) / 1024:.0f}"),
        ("smoke suite, s", smoke_s),
        ("first start to /readyz 200, s (embedded default: publish, sync, select, load)", r["first_start_s"]),
        (f"cold start to /readyz 200, s (restart, decision cached; median of {len(r['restarts_s'])})", r["cold_start_s"]),
        ("RSS idle, MB: embedded default (half_plus_two)", r["rss_idle_mb"]),
        ("RSS idle, MB: TFLite folder (MLP, two-signature, no-signature models)", r["rss_idle_folder_mb"]),
        ("hot swap: `appliance publish` of v2 to v2 answering, s", f"{r['swap_s']} ({r['swap_requests']} requests "
         f"across it: {r['swap_answers']['v1']} answered by v1, {r['swap_answers']['v2']} by v2, none failed)"),
    ]:
        rows.setdefault(key, []).append(str(value))
lines = [
    f"\n## aarch64 under emulation (LiteRT-only install), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
    f"Host: {platform.machine()}, {os.cpu_count()} CPUs, shared (load average {os.getloadavg()[0]:.1f} at the end). "
    f"Guest: Debian bookworm arm64 userland "
    f"(debootstrap), Python {r['python']}, run by {qemu_v} through binfmt_misc. Command: "
    f"`scripts/arm64-check.sh --record` (rootfs cached), {wall_s} s wall time in all.\n",
    "**Emulated times are not device times**: qemu-user translates every aarch64 instruction, so starts, "
    "installs and the swap take several times longer than on a board. Sizes on disk are the guest's own; RSS "
    "is the emulator process's, so it counts qemu's translated code and its own heap on top of the service: an "
    "upper bound for a board, not its figure.\n",
    "| figure | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols),
    *[f"| {k} | " + " | ".join(v) + " |" for k, v in rows.items()],
]
text = "\n".join(lines) + "\n"
print(text)
if record == "1":
    with open(results_md, "a") as f:
        f.write(text)
PY
log "PASSED in ${wall_s} s"
