#!/usr/bin/env bash
# Smoke-test the images that images/build.sh built: start each one with podman, as its own non-root
# user, with no network and a read-only root filesystem, and check that it does its job:
#   every image      the image's user is 10001:10001, `id -u` in the container is not 0,
#                    `modelfleet --help` lists the commands
#   operator         `modelfleet operator --help`
#   agent-cpu        torch is the CPU build
#   agent-openvino   Debian's Intel OpenCL ICD is registered; `import openvino`: its version, and
#                    the CPU device is there (a GPU device shows only with /dev/dri)
#   agent-cuda       torch is a CUDA build (torch.version.cuda) and loads cuDNN; no GPU is needed
#   every agent-*    `modelfleet generate` serves the bundled demo model (models/demo, mounted
#                    read-only) on the CPU for 8 tokens of "def "
# Prints one line per check with its time, then each image's size; exits 1 if any check failed.
#   bash images/smoke.sh                          # every built image
#   IMAGES="agent-cpu" bash images/smoke.sh
#   OCI_RUNTIME=crun bash images/smoke.sh         # default: runc if installed, else crun
# podman runs as root with --cgroup-manager cgroupfs and the ulimits build.sh uses, which work on
# hosts without systemd or cgroup delegation. crun refuses hosts with hybrid cgroups (v1
# controllers plus a v2 mount): install runc there (Debian: apt-get install runc).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY=${REGISTRY:-ghcr.io/modelfleet}
OCI_RUNTIME=${OCI_RUNTIME:-$(command -v runc || command -v crun || echo runc)}
PODMAN=(podman --runtime "$OCI_RUNTIME" --cgroup-manager cgroupfs)
RUN=("${PODMAN[@]}" run --rm --network=none --read-only --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)

if [[ -z ${IMAGES:-} ]]; then
  IMAGES=""
  for image in operator agent-cpu agent-openvino agent-cuda; do
    if podman image exists "$REGISTRY/$image:$VERSION"; then IMAGES+="$image "; fi
  done
fi
if [[ -z ${IMAGES// /} ]]; then
  echo "no image $REGISTRY/*:$VERSION here: run images/build.sh first" >&2
  exit 1
fi

failures=0
# check IMAGE NAME EXPECT-REGEX PODMAN-RUN-ARGS...: run the container, match its output
check() {
  local image=$1 name=$2 expect=$3 out status t0 t1
  shift 3
  t0=$(date +%s%N)
  if out=$("${RUN[@]}" "$@" 2>&1) && grep -Eq -- "$expect" <<< "$out"; then status=ok; else status=FAIL; fi
  t1=$(date +%s%N)
  printf '%-15s %-10s %-4s %6.1f s  %s\n' "$image" "$name" "$status" "$(((t1 - t0) / 1000000))e-3" \
    "$(grep -Eo -m1 -- "$expect" <<< "$out" || true)"
  if [[ $status == FAIL ]]; then
    failures=$((failures + 1))
    echo "  expected /$expect/ in the output of: ${RUN[*]} $*" >&2
    tail -n 20 <<< "$out" | sed 's/^/  | /' >&2
  fi
}

for image in $IMAGES; do
  ref=$REGISTRY/$image:$VERSION
  user=$(podman image inspect --format '{{.Config.User}}' "$ref")
  if [[ $user == 10001:10001 ]]; then status=ok; else status=FAIL failures=$((failures + 1)); fi
  printf '%-15s %-10s %-4s %6s    %s\n' "$image" user "$status" - "$user"
  check "$image" "id -u" '^[1-9][0-9]*$' --entrypoint id "$ref" -u
  check "$image" --help 'operator +Run the ModelFleet operator' "$ref" --help
  case $image in
    operator)
      check "$image" operator 'Usage: modelfleet operator' "$ref" operator --help
      ;;
    agent-cpu)
      check "$image" torch '^[0-9.]+\+cpu$' --entrypoint python "$ref" -c 'import torch; print(torch.__version__)'
      ;;
    agent-openvino)
      check "$image" opencl 'libigdrcl\.so' --entrypoint cat "$ref" /etc/OpenCL/vendors/intel.icd
      check "$image" openvino "^2026\.[^ ]+ \['CPU'" --entrypoint python "$ref" -c \
        'import openvino; print(openvino.get_version(), openvino.Core().available_devices)'
      ;;
    agent-cuda)
      check "$image" torch '^[0-9.]+\+cu[0-9]+ cuda [0-9]+\.[0-9]+ cudnn [0-9]+ gpus [0-9]+$' \
        --entrypoint python "$ref" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda,
"cudnn", torch.backends.cudnn.version(), "gpus", torch.cuda.device_count())'
      ;;
  esac
  if [[ $image == agent-* ]]; then
    check "$image" generate '"token_ids": \[[0-9]+(, [0-9]+){7}\]' \
      -v "$ROOT/models/demo:/models/demo:ro" "$ref" \
      generate --model /models/demo --prompt "def " --max-tokens 8 --json
  fi
done

echo
for image in $IMAGES; do
  ref=$REGISTRY/$image:$VERSION
  bytes=$(podman image inspect --format '{{.Size}}' "$ref")
  printf '%-40s %6.2f GB\n' "$ref" "$((bytes / 10000000))e-2"
done
if ((failures)); then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "every check passed"
