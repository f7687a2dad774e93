#!/usr/bin/env bash
# Build the operator and agent-cpu images with buildah/podman, without pulling any image and with no
# network inside the builds:
#   1. debootstrap a minimal Debian bookworm root that already holds the Containerfiles' apt
#      packages, and import it as the base image (localhost/modelfleet/bookworm:12);
#   2. build modelfleet's wheel and `pip download` every dependency wheel on the host (CPU torch);
#   3. `buildah build --network=none` each Containerfile; pip installs with --no-index.
# Needs root (or rootless podman), debootstrap, buildah, podman and pip. CI does not run it.
# Measured on the 2-core dev machine (Debian podman 4.3, buildah 1.28): base 46 s, wheels 13 s,
# operator 93 s, agent-cpu 77 s, 3 min 49 s in all; each image is 1.37 GB (torch CPU included).
#   bash images/build.sh            # operator and agent-cpu
#   IMAGES="operator" bash images/build.sh
#   PIP_INDEX_ARGS="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"
#     where pip's configured index does not serve the CPU torch wheel
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY=${REGISTRY:-ghcr.io/modelfleet}
IMAGES=${IMAGES:-"operator agent-cpu"}
BASE=localhost/modelfleet/bookworm:12
WORK=${WORK:-$ROOT/build/images}
PYTHON=${PYTHON:-python3}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# podman/buildah settings that work on hosts without systemd or cgroup delegation
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)

mkdir -p "$WORK"
start=$(date +%s)

if ! buildah inspect --type image "$BASE" > /dev/null 2>&1; then
  rootfs=$WORK/rootfs
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv bookworm "$rootfs" "$MIRROR"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE"
  echo "base image $BASE after $(( $(date +%s) - start )) s"
fi

context=$WORK/context
rm -rf "$context" && mkdir -p "$context/wheels"
"$PYTHON" -m pip wheel --no-deps -w "$context/wheels" "$ROOT"
"$PYTHON" -m pip download -d "$context/wheels" --only-binary=:all: --python-version 3.11 \
  ${PIP_INDEX_ARGS:-} "torch==2.13.0" "$context/wheels/modelfleet-$VERSION-py3-none-any.whl"
echo "wheels after $(( $(date +%s) - start )) s"

for image in $IMAGES; do
  buildah build --network=none "${ULIMITS[@]}" --layers \
    --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" \
    -f "$ROOT/images/$image/Containerfile" -t "$REGISTRY/$image:$VERSION" "$context"
  echo "$REGISTRY/$image:$VERSION after $(( $(date +%s) - start )) s"
done
