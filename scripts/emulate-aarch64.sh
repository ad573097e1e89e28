#!/usr/bin/env bash
# Run a command where aarch64 programs run under qemu-user, without registering anything on the
# host: a private user + mount namespace (uids 0-65535 are the host's own, so root stays root)
# with a binfmt_misc instance of its own (kernel 6.7+), gone with the namespace even if this is
# killed. scripts/image.sh uses it to build an arm64 Debian base with mmdebstrap (its maintainer
# scripts are aarch64 programs) and to run the arm64 image's smoke test; scripts/arm64-check.sh
# does the same for its chroot.
#
#   scripts/emulate-aarch64.sh CMD...        # as root on an x86-64 Debian host
#
# The emulator: $ARM64_QEMU, else Debian's qemu-user-static (installed when missing), else the
# qemu 9+ scripts/arm64-check.sh keeps in its cache. A static build: binfmt's F flag opens it
# now, so it need not exist inside a chroot or a container.
set -euo pipefail

log() { printf '[emulate-aarch64] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

if [ "${_EMU_IN_NS:-}" = 1 ]; then
  # Mounted where tools look for it (mmdebstrap checks /proc/mounts), in this namespace only.
  bfm=/proc/sys/fs/binfmt_misc
  mount -t binfmt_misc binfmt_misc "$bfm" || die "cannot mount a private binfmt_misc (kernel 6.7+ needed)"
  # The \x escapes are the kernel's to decode: printed as they stand.
  printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$_EMU_QEMU"':FC' \
    > "$bfm/register"
  unset _EMU_IN_NS _EMU_QEMU
  exec "$@"
fi

[ $# -gt 0 ] || { sed -n '2,12s/^# \{0,1\}//p' "$0" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "run as root (a user namespace with the host's uids, and mounts)"

qemu=${ARM64_QEMU:-}
if [ -z "$qemu" ]; then
  for q in /usr/bin/qemu-aarch64-static /var/cache/edge-appliance-arm64/qemu/usr/bin/qemu-aarch64; do
    [ -x "$q" ] && { qemu=$q; break; }
  done
fi
if [ -z "$qemu" ]; then
  log "installing qemu-user-static from Debian's packages"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user-static >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user-static >/dev/null; } \
    || die "apt-get install qemu-user-static"
  qemu=/usr/bin/qemu-aarch64-static
fi

# The namespace: unshare waits on a fifo until its uid/gid maps are written from out here.
fifo=$(mktemp -u); mkfifo "$fifo"
_EMU_IN_NS=1 _EMU_QEMU="$qemu" unshare --user --mount --propagation private -- \
  sh -c 'read go < "$0"; shift; exec "$@"' "$fifo" x bash "$0" "$@" &
pid=$!
me=$(readlink /proc/self/ns/user)
for _ in $(seq 200); do
  [ "$(readlink "/proc/$pid/ns/user" 2>/dev/null)" != "$me" ] && break
  sleep 0.05
done
[ "$(readlink "/proc/$pid/ns/user" 2>/dev/null)" != "$me" ] || { kill "$pid"; rm -f "$fifo"; die "unshare did not enter a user namespace within 10 s"; }
echo "0 0 65536" > "/proc/$pid/uid_map"
echo "0 0 65536" > "/proc/$pid/gid_map"
echo go > "$fifo"; rm -f "$fifo"
wait "$pid"
