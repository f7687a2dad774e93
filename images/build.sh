#!/usr/bin/env bash
# Build the modelfleet images with buildah/podman, without pulling any image and with no network
# inside the builds:
#   1. debootstrap a minimal Debian bookworm root that already holds the Containerfiles' apt
#      packages, and import it as a base image: localhost/modelfleet/bookworm:12 (python3), and for
#      agent-openvino localhost/modelfleet/bookworm-intel:12 (plus Debian's Intel compute runtime);
#   2. build modelfleet's wheel and `pip download` every dependency wheel on the host: the CPU set
#      (torch CPU build, plus openvino for agent-openvino) and, for agent-cuda, the CUDA set (PyPI's
#      torch wheel, which is the CUDA build, and its nvidia-* wheels);
#   3. `buildah build --network=none` each Containerfile (no layer cache); each runs images/runtime.sh
#      (copied into its context: pinned packages, user 10001, venv) and pip installs with --no-index.
# Needs root (or rootless podman), debootstrap, buildah, podman and pip. CI does not run it.
# images/smoke.sh then runs each built image; images/README.md has the measured times and sizes.
#   bash images/build.sh                        # all four images
#   IMAGES="operator agent-cpu" bash images/build.sh
#   PIP_INDEX_ARGS="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"
#     where pip's configured index does not serve the CPU torch wheel
#   CUDA_PIP_INDEX_ARGS="--index-url https://mirror.example/simple"   # where the CUDA wheels come from
#   BUILDAH_ARGS="--squash" bash images/build.sh   # more buildah build options
# Downloaded wheels stay in build/images/wheels-{cpu,cuda} and are reused; rm -r build/images to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY=${REGISTRY:-ghcr.io/modelfleet}
IMAGES=${IMAGES:-"operator agent-cpu agent-openvino agent-cuda"}
TORCH=${TORCH:-torch==2.13.0}
OPENVINO=${OPENVINO:-openvino==2026.4.1}
# structured output's grammar library, downloaded without its declared dependencies (its wheel
# declares triton, which the mask never uses); the agents install modelfleet[structured] beside it
XGRAMMAR=${XGRAMMAR:-xgrammar==0.2.9}
WORK=${WORK:-$ROOT/build/images}
PYTHON=${PYTHON:-python3}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CUDA_PIP_INDEX_ARGS=${CUDA_PIP_INDEX_ARGS:-"--index-url https://pypi.org/simple"}
# podman/buildah settings that work on hosts without systemd or cgroup delegation
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)

mkdir -p "$WORK"
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
wants() { [[ " $IMAGES " == *" $1 "* ]]; }

# base IMAGE PACKAGES: debootstrap a bookworm root holding PACKAGES and import it as IMAGE (once)
base() {
  if buildah inspect --type image "$1" > /dev/null 2>&1; then return; fi
  local rootfs=$WORK/rootfs
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include="$2" bookworm "$rootfs" "$MIRROR"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$1"
  rm -rf "$rootfs"
  echo "base image $1 after $(elapsed)"
}
BASE=localhost/modelfleet/bookworm:12
# an existing image with a newer Intel compute runtime can stand in: BASE_INTEL=IMAGE
BASE_INTEL=${BASE_INTEL:-localhost/modelfleet/bookworm-intel:12}
# gcc, libc6-dev: the CPU expert kernel is compiled on the node at first use (-march=native)
base "$BASE" ca-certificates,python3,python3-venv,gcc,libc6-dev
if wants agent-openvino; then
  base "$BASE_INTEL" ca-certificates,python3,python3-venv,intel-opencl-icd,libze1,ocl-icd-libopencl1
fi

# Each wheel set is a build context: context-SET/wheels
wheel=modelfleet-$VERSION-py3-none-any.whl
# built from a copy of the checkout's files (tracked and untracked, not ignored): setuptools'
# in-tree build/lib would carry modules deleted since its last build into the wheel
src=$WORK/src
rm -rf "$src" "$WORK/dist" && mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | tar -c --null --ignore-failed-read -T - | tar -x -C "$src"
"$PYTHON" -m pip wheel --no-deps -w "$WORK/dist" "$src"
download() { # SET PIP-DOWNLOAD-ARGS...
  local set=$1 dir=$WORK/context-$1/wheels pipenv=()
  shift
  if [[ $set == cuda ]]; then
    # PyPI's Linux torch wheel is the CUDA build. A host's pip configuration may put a local CPU
    # build first (find-links: 2.13.0+cpu sorts above 2.13.0), so this download ignores it.
    pipenv=(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null)
  fi
  mkdir -p "$dir"
  rm -f "$dir"/modelfleet-*.whl
  cp "$WORK/dist/$wheel" "$dir/"
  "${pipenv[@]}" "$PYTHON" -m pip download -d "$dir" --only-binary=:all: --python-version 3.11 \
    --progress-bar off "$@" "$dir/$wheel[structured]"
  "${pipenv[@]}" "$PYTHON" -m pip download -d "$dir" --only-binary=:all: --python-version 3.11 \
    --progress-bar off --no-deps "$XGRAMMAR"
  local torch_wheels
  torch_wheels=$(cd "$dir" && echo torch-*.whl)
  if [[ $set == cpu && $torch_wheels != *+cpu* ]] || [[ $set == cuda && $torch_wheels == *+cpu* ]]; then
    echo "wheels for $set hold $torch_wheels: set PIP_INDEX_ARGS (cpu) or CUDA_PIP_INDEX_ARGS (cuda)" >&2
    exit 1
  fi
}
if wants operator || wants agent-cpu || wants agent-openvino; then
  extra=()
  if wants agent-openvino; then extra=("$OPENVINO"); fi
  # shellcheck disable=SC2086  # PIP_INDEX_ARGS is a list of words
  download cpu ${PIP_INDEX_ARGS:-} "$TORCH" "${extra[@]}"
fi
if wants agent-cuda; then
  # shellcheck disable=SC2086  # CUDA_PIP_INDEX_ARGS is a list of words
  download cuda $CUDA_PIP_INDEX_ARGS "$TORCH"
fi
echo "wheels after $(elapsed)"

for image in $IMAGES; do
  case $image in
    agent-cuda) set=cuda ;;
    *) set=cpu ;;
  esac
  case $image in
    agent-openvino) from=$BASE_INTEL ;;
    *) from=$BASE ;;
  esac
  cp "$ROOT/images/runtime.sh" "$WORK/context-$set/runtime.sh"  # the steps every image shares
  t=$(date +%s)
  # No layer cache: a cached pip layer would survive a new modelfleet wheel (buildah does not hash
  # the bind-mounted wheels), so every build installs the wheels it is given.
  # shellcheck disable=SC2086  # BUILDAH_ARGS is a list of words
  buildah build --network=none --layers=false "${ULIMITS[@]}" ${BUILDAH_ARGS:-} \
    --build-arg BASE="$from" --build-arg VERSION="$VERSION" \
    -f "$ROOT/images/$image/Containerfile" -t "$REGISTRY/$image:$VERSION" "$WORK/context-$set"
  echo "$REGISTRY/$image:$VERSION built in $(($(date +%s) - t)) s, after $(elapsed)"
done
