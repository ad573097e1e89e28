#!/bin/sh
# Remove the edge-appliance service installed by systemd/install.sh.
#
#   sudo systemd/uninstall.sh [--purge] [--prefix DIR] [--root DIR]
#
# Stops and disables the unit, removes it with its drop-ins and the venv. The config
# (/etc/edge-appliance), the model store and state (/var/lib/edge-appliance), the cache
# and logs and the user stay, so a re-install serves the same models at once; --purge
# removes those too. --root DIR works on a tree staged with install.sh --root.
set -eu

PREFIX=/opt/edge-appliance
ROOT=
PURGE=no
NAME=edge-appliance
UNIT=$NAME.service

while [ $# -gt 0 ]; do
    case "$1" in
    --purge) PURGE=yes; shift;;
    --prefix) PREFIX=${2:?}; shift 2;;
    --root) ROOT=${2:?}; shift 2;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed 's/^# \{0,1\}//;/^set -eu/d'; exit 0;;
    *) echo "uninstall.sh: unknown option $1" >&2; exit 2;;
    esac
done
[ -n "$ROOT" ] || [ "$(id -u)" = 0 ] || { echo "uninstall.sh: run as root" >&2; exit 2; }

if [ -z "$ROOT" ] && command -v systemctl >/dev/null; then
    systemctl disable --now "$UNIT" 2>/dev/null || true
fi
rm -rf "$ROOT/etc/systemd/system/$UNIT" "$ROOT/etc/systemd/system/$UNIT.d" "$ROOT$PREFIX"
[ -n "$ROOT" ] || ! command -v systemctl >/dev/null || systemctl daemon-reload

if [ "$PURGE" = yes ]; then
    rm -rf "$ROOT/etc/$NAME" "$ROOT/var/lib/$NAME" "$ROOT/var/lib/private/$NAME" \
        "$ROOT/var/cache/$NAME" "$ROOT/var/log/$NAME"
    if [ -z "$ROOT" ] && getent passwd "$NAME" >/dev/null; then
        userdel "$NAME"
    fi
    echo "removed $UNIT, its venv, config, state, cache, logs and user"
else
    echo "removed $UNIT and its venv; kept /etc/$NAME and /var/lib/$NAME (--purge removes them)"
fi
