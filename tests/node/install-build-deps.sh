#!/usr/bin/env bash
# The Debian packages the real node and its images need, installed once (apt-get; idempotent):
# - libseccomp-dev (+ pkg-config): libseccomp's headers. runc is built from its Go module with cgo
#   and the `seccomp` tag (support/node/binaries.py); without it runc refuses any container that
#   carries a seccomp filter, and containerd gives every pod sandbox one (RuntimeDefault).
# - iptables: kube-proxy programs Services with it (this kernel has x_tables and nf_tables; the
#   Debian command is the nft-backed one, as on current distributions).
# - debootstrap: makes the Debian base the operator image is built on (no registry is reachable,
#   so the official python image cannot be pulled; support/images/base.py).
# Needs root, as CI and the development machines have it.
set -euo pipefail
missing=()
{ [ -e /usr/include/seccomp.h ] && pkg-config --exists libseccomp 2>/dev/null; } || missing+=(libseccomp-dev pkg-config)
command -v iptables >/dev/null || missing+=(iptables)
command -v debootstrap >/dev/null || missing+=(debootstrap)
[ ${#missing[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null \
  || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
