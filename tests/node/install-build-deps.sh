#!/usr/bin/env bash
# The one Debian package the real node's build needs: libseccomp-dev, the headers of libseccomp
# (its runtime, libseccomp2, is on every Debian). runc is built from its Go module with cgo and
# the `seccomp` tag (support/node/binaries.py); without it runc refuses any container that
# carries a seccomp filter, and containerd gives every pod sandbox one (RuntimeDefault).
# Idempotent; needs root, as CI and the development machines have it.
set -euo pipefail
if [ -e /usr/include/seccomp.h ] && pkg-config --exists libseccomp 2>/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends libseccomp-dev pkg-config >/dev/null \
  || { apt-get update >/dev/null && apt-get install -y --no-install-recommends libseccomp-dev pkg-config >/dev/null; }
