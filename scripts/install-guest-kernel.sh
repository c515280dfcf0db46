#!/bin/sh
# Installs the QEMU backend's guest kernel (`AENV_RUNTIME=qemu`, src/aenv/runtime/qemu/):
# Debian's cloud kernel, unpacked from its package into DEST (never installed on the host:
# no /boot entry, no initramfs hooks), with the few modules the guest loads from its own
# initramfs (the cloud kernel builds every virtio driver as a module). Idempotent: with a
# kernel in DEST it returns at once.
set -eu
DEST=${1:-/usr/local/lib/aenv/guest}
[ -f "$DEST/vmlinuz" ] && [ -f "$DEST/release" ] && exit 0
MODULES="virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net overlay virtio_console virtio-rng"
echo "aenv: installing the guest kernel into $DEST" >&2
tmp=$(mktemp -d)
chmod 755 "$tmp"  # apt-get download fetches as _apt
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
pkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)
if [ -z "$pkg" ]; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    pkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)
fi
[ -n "$pkg" ] || { echo "aenv: no linux-image-cloud-amd64 package found" >&2; exit 1; }
apt-get download -qq "$pkg" >/dev/null
dpkg-deb -x ./*.deb x
release=$(ls x/lib/modules | head -n1)
mkdir -p "$DEST.new/modules"
cp x/boot/vmlinuz-"$release" "$DEST.new/vmlinuz"
for m in $MODULES; do
    f=$(find x/lib/modules/"$release" -name "$m.ko*" | head -n1)
    [ -n "$f" ] || { echo "aenv: module $m missing from $pkg" >&2; exit 1; }
    case "$f" in
        *.xz) xz -dc "$f" >"$DEST.new/modules/$m.ko" ;;
        *.zst) zstd -qdc "$f" >"$DEST.new/modules/$m.ko" ;;
        *) cp "$f" "$DEST.new/modules/$m.ko" ;;
    esac
done
echo "$MODULES" >"$DEST.new/modules/order"
echo "$release" >"$DEST.new/release"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$DEST.new" "$DEST"
