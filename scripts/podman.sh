#!/usr/bin/env bash
# Make podman usable for tests/test_container.py, and build its base image once.
#
# No registry can be reached here, so the base image is a minimal Debian made by debootstrap
# from the mirror apt already uses, with Debian's python3 and python3-venv, imported into
# podman. Idempotent and cached: installs only what is missing, skips the base image when it
# exists. Prints, on stdout, what to use:
#   CONTAINERS_CONF=<our containers.conf>     (and always run `podman --runtime runc`)
#   SHARDFLOW_BASE_IMAGE=<the base image>      (for `podman build --build-arg BASE=...`)
#
#   SHARDFLOW_BASE_IMAGE=NAME     name of the base image (default localhost/shardflow-base:<codename>)
#   SHARDFLOW_PODMAN_NO_INSTALL=1 say what is missing instead of installing it (the test's mode)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "podman.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# need TOOL...: install those missing (apt-get), or say which are missing.
need() {
  local missing=() tool
  for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  ((${#missing[@]})) || return 0
  [ -z "${SHARDFLOW_PODMAN_NO_INSTALL:-}" ] || die "missing ${missing[*]}: run scripts/podman.sh"
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: install them (needs root)"
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}
need podman runc

# Our own containers.conf: cgroupfs (no systemd here), no default ulimits (runc's setting of
# RLIMIT_NOFILE is refused in a VM like this one), the file event log (no journald).
conf_dir=.tools/podman
conf=$conf_dir/containers.conf
mkdir -p "$conf_dir"
cat >"$conf.new" <<'EOF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
EOF
mv "$conf.new" "$conf"
export CONTAINERS_CONF=$PWD/$conf
podman() { command podman --runtime runc "$@"; }

# The base image follows the host's Debian release, so its mirror serves that suite.
# shellcheck source=/dev/null
. /etc/os-release
[ "${ID:-}" = debian ] || die "the base image is made with debootstrap from a Debian host's mirror"
codename=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
base=${SHARDFLOW_BASE_IMAGE:-localhost/shardflow-base:$codename}

# One build at a time: two test runs must not debootstrap into each other.
exec 9>"$conf_dir/lock"
flock 9
report() { printf 'CONTAINERS_CONF=%s\nSHARDFLOW_BASE_IMAGE=%s\n' "$CONTAINERS_CONF" "$base"; }
if podman image exists "$base"; then
  report
  exit 0
fi

# The first non-security Debian mirror of apt's sources (deb822 or one-line format).
mirror=$(
  {
    grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources \
      | awk '{for (i = 2; i <= NF; i++) print $i}' || true
    grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
      | sed -E 's/^deb +(\[[^]]*\] +)?//' | awk '{print $1}'
  } 2>/dev/null | grep -E '/debian/?$' | head -n 1 || true
)
[ -n "$mirror" ] || die "no Debian mirror found in /etc/apt/sources.list*"

need debootstrap
rootfs=$(mktemp -d /var/tmp/shardflow-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
log "debootstrap $codename from $mirror (once; a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  "$codename" "$rootfs" "$mirror" >"$conf_dir/debootstrap.log" 2>&1 \
  || { tail -n 20 "$conf_dir/debootstrap.log" >&2; die "debootstrap failed"; }

# Trust what the host trusts (a local CA in front of the package index, if any), so pip in
# the image reaches the same index as the host's pip.
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
fi
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

log "importing $base"
tar -C "$rootfs" -c . | podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
report
