#!/bin/sh
# Install edge-appliance as a systemd service. Run as root from a checkout (or an
# unpacked sdist) of the project. See systemd/README.md.
#
#   sudo systemd/install.sh [--devices LIST] [--extras LIST] [--package SPEC]
#                           [--prefix DIR] [--no-start] [--root DIR] [--no-venv]
#   systemd/install.sh --print-dropin LIST
#
# What it does, each step skipped when already done (safe to run again to upgrade):
#   1. system user and group "edge-appliance" (no login, no home of its own)
#   2. venv at PREFIX/venv (default /opt/edge-appliance/venv) with the package installed
#   3. /etc/edge-appliance/appliance.toml from the example; an existing file is kept and
#      the new example written next to it as appliance.toml.example
#   4. /etc/systemd/system/edge-appliance.service, and with --devices a drop-in
#      edge-appliance.service.d/devices.conf granting only those device nodes
#   5. systemctl daemon-reload, enable, and (unless --no-start) restart
#
# --devices LIST   comma-separated: nvidia (CUDA GPU: tf-gpu, TF-TRT), dri (GPU
#                  delegate of LiteRT through /dev/dri: Intel, Mali, Adreno),
#                  edgetpu (PCIe/M.2 Coral, /dev/apex_0), coral-usb (USB Coral)
# --extras LIST    the package's extras to install (default: tflite; a GPU or
#                  SavedModel box: tf,tflite; an S3 bucket: add s3; text models
#                  for the OpenAI API: add llm)
# --package SPEC   what pip installs into the venv (default: this checkout with --extras)
# --root DIR       stage every file under DIR instead of / (packaging, tests): no user
#                  is created, nothing is chowned, systemctl is not run (add --no-venv:
#                  a venv only works at the path it was created at)
# --no-venv        skip step 2 (the venv is managed some other way)
# --print-dropin LIST   print the drop-in for LIST and exit
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=/opt/edge-appliance
ROOT=
DEVICES=
PACKAGE=
EXTRAS=tflite
VENV=yes
START=yes
NAME=edge-appliance
UNIT=$NAME.service

die() { echo "install.sh: $*" >&2; exit 2; }

dropin_for() {  # $1: one device kind → the lines it needs
    case "$1" in
    nvidia) cat <<'EOF'
# NVIDIA GPU (backend tf-gpu, TF-TRT): the driver's character devices
# (/dev/nvidia0..N and /dev/nvidiactl are "nvidia-frontend", /dev/nvidia-uvm* "nvidia-uvm").
# Jetson instead: DeviceAllow=/dev/nvmap rw, DeviceAllow=char-nvhost rw (see ls -l /dev).
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-uvm rw
DeviceAllow=char-nvidia-caps rw
DeviceAllow=/dev/nvidia-modeset rw
SupplementaryGroups=video
EOF
    ;;
    dri) cat <<'EOF'
# GPU delegate of LiteRT through DRM render nodes (/dev/dri/renderD*, /dev/dri/card*).
# A Mali GPU with the vendor kernel driver instead: DeviceAllow=/dev/mali0 rw
DeviceAllow=char-drm rw
SupplementaryGroups=video render
EOF
    ;;
    edgetpu) cat <<'EOF'
# Coral EdgeTPU on PCIe / M.2 (gasket + apex drivers create /dev/apex_0, group apex).
DeviceAllow=/dev/apex_0 rw
SupplementaryGroups=apex
EOF
    ;;
    coral-usb) cat <<'EOF'
# Coral USB Accelerator: libusb opens /dev/bus/usb/*/* (group plugdev by Coral's udev rule).
DeviceAllow=char-usb_device rw
SupplementaryGroups=plugdev
EOF
    ;;
    *) die "unknown device kind '$1' (nvidia, dri, edgetpu, coral-usb)";;
    esac
}

print_dropin() {  # $1: comma-separated kinds
    old_ifs=$IFS; IFS=,
    for kind in $1; do IFS=$old_ifs; dropin_for "$kind" >/dev/null; done  # unknown kind: die first
    IFS=$old_ifs
    echo "# Written by systemd/install.sh --devices $1: the device nodes this box's"
    echo "# accelerators need, and nothing else (DevicePolicy=closed stays in force)."
    echo "[Service]"
    echo "PrivateDevices=no"
    echo "DevicePolicy=closed"
    old_ifs=$IFS; IFS=,
    for kind in $1; do IFS=$old_ifs; dropin_for "$kind"; done
    IFS=$old_ifs
}

while [ $# -gt 0 ]; do
    case "$1" in
    --devices) DEVICES=${2:?}; shift 2;;
    --package) PACKAGE=${2:?}; shift 2;;
    --extras) EXTRAS=${2:?}; shift 2;;
    --prefix) PREFIX=${2:?}; shift 2;;
    --root) ROOT=${2:?}; shift 2;;
    --no-venv) VENV=no; shift;;
    --no-start) START=no; shift;;
    --print-dropin) print_dropin "${2:?}"; exit 0;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed 's/^# \{0,1\}//;/^set -eu/d'; exit 0;;
    *) die "unknown option $1 (try --help)";;
    esac
done

[ -n "$ROOT" ] || [ "$(id -u)" = 0 ] || die "run as root (or stage with --root DIR)"
[ -n "$PACKAGE" ] || PACKAGE="$(dirname "$HERE")[$EXTRAS]"
[ -n "$DEVICES" ] && print_dropin "$DEVICES" >/dev/null  # fail early on an unknown kind

# 1. user
if [ -z "$ROOT" ] && ! getent passwd "$NAME" >/dev/null; then
    useradd --system --user-group --no-create-home --home-dir "/var/lib/$NAME" \
        --shell /usr/sbin/nologin --comment "edge-appliance model server" "$NAME"
    for group in video render apex plugdev; do  # accelerators' device groups, where they exist
        getent group "$group" >/dev/null && usermod -a -G "$group" "$NAME"
    done
fi

# 2. venv
if [ "$VENV" = yes ]; then
    python3 -m venv "$ROOT$PREFIX/venv" || die "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
    "$ROOT$PREFIX/venv/bin/pip" install --upgrade --quiet pip
    "$ROOT$PREFIX/venv/bin/pip" install --upgrade --quiet "$PACKAGE"
fi
install -d -m 0755 "$ROOT$PREFIX/systemd"
install -m 0644 "$HERE/README.md" "$HERE/appliance.toml" "$ROOT$PREFIX/systemd/"

# 3. config: never overwrite the operator's file
install -d -m 0755 "$ROOT/etc/$NAME"
if [ -e "$ROOT/etc/$NAME/appliance.toml" ]; then
    install -m 0644 "$HERE/appliance.toml" "$ROOT/etc/$NAME/appliance.toml.example"
    echo "kept /etc/$NAME/appliance.toml; the new example is appliance.toml.example"
else
    install -m 0640 "$HERE/appliance.toml" "$ROOT/etc/$NAME/appliance.toml"
    [ -n "$ROOT" ] || chgrp "$NAME" "/etc/$NAME/appliance.toml"
fi

# 4. unit (+ devices drop-in)
install -d -m 0755 "$ROOT/etc/systemd/system"
sed "s#/opt/edge-appliance/#$PREFIX/#g" "$HERE/$UNIT" > "$ROOT/etc/systemd/system/$UNIT"
chmod 0644 "$ROOT/etc/systemd/system/$UNIT"
if [ -n "$DEVICES" ]; then
    install -d -m 0755 "$ROOT/etc/systemd/system/$UNIT.d"
    print_dropin "$DEVICES" > "$ROOT/etc/systemd/system/$UNIT.d/devices.conf"
fi

# 5. systemd
if [ -z "$ROOT" ]; then
    systemctl daemon-reload
    systemctl enable "$UNIT"
    if [ "$START" = yes ]; then
        systemctl restart "$UNIT"
        echo "started: systemctl status $UNIT; journalctl -u $UNIT -f"
    fi
fi
echo "installed $UNIT (config /etc/$NAME/appliance.toml, venv $PREFIX/venv)"
