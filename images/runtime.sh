#!/bin/sh
# The steps every modelfleet image shares, run as root by each Containerfile during the build
# (images/build.sh puts this file and the wheels/ folder in the build context):
#   - Debian packages the runtime needs, pinned; build.sh's debootstrapped bases already hold
#     them, so apt (and the network) is used only on another base;
#   - the unprivileged user the images run as (uid 10001, no home, no shell);
#   - a venv at /opt/modelfleet with REQUIREMENTs installed offline from /tmp/wheels (--no-index),
#     then --without-deps ones without their declared dependencies (xgrammar: its wheel declares
#     triton, which the structured-output mask never uses; the "structured" extra brings what it
#     imports), and `modelfleet --help` as the build check.
# Usage: sh runtime.sh [--debs "NAME=VERSION ..."] [--without-deps REQUIREMENT] REQUIREMENT...
set -eu
debs="ca-certificates=20230311+deb12u1 python3=3.11.2-1+b1 python3-venv=3.11.2-1+b1"
if [ "${1:-}" = --debs ]; then
  debs="$debs $2"
  shift 2
fi
names=""
bare=""
if [ "${1:-}" = --without-deps ]; then
  bare=$2
  shift 2
fi
for deb in $debs; do names="$names ${deb%%=*}"; done
# shellcheck disable=SC2086  # word lists
if ! dpkg-query -W $names > /dev/null 2>&1; then
  apt-get update
  apt-get install -y --no-install-recommends $debs
fi
rm -rf /var/lib/apt/lists/*
useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin modelfleet
python3 -m venv /opt/modelfleet
/opt/modelfleet/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels "$@"
if [ -n "$bare" ]; then
  /opt/modelfleet/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels --no-deps "$bare"
fi
/opt/modelfleet/bin/modelfleet --help > /dev/null
