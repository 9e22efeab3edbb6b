#!/bin/sh
# GPU and fabric pre-flight check of one GPU node, run once when the node's gpu-preflight pod starts.
#
# Usage (in the gpu-preflight DaemonSet, infra/k8s/health.py; by hand on a node: same environment):
#   RESULTS_DIR=/results DCGM_DIAG_LEVEL=1 sh gpu-preflight.sh
# It waits for $RESULTS_DIR/expected.env (written by preflight_server.py from the node's pool: what
# the platform contract says this node has), runs every check, and writes one file per check:
# `<check>.ok` or `<check>.fail`, holding one line of detail. The server answers the node readiness
# reporters from those files; a failed check leaves the node's pre-flight taint of that check in place.
#
# Checks (a check's name is the last part of its taint, readiness.k8s.io/gpu-train-preflight-<check>):
#   gpus    nvidia-smi sees EXPECTED_GPUS GPUs
#   ecc     no GPU has uncorrectable volatile ECC errors, a pending row remap (needs a GPU reset) or a
#           failed row remap (nvidia-smi --help-query-gpu: ecc.errors.uncorrected.volatile.total,
#           remapped_rows.pending, remapped_rows.failure; "[N/A]" where the GPU has no such counter)
#   dcgm    `dcgmi diag -r DCGM_DIAG_LEVEL` passes, against a host engine started for the check
#   fabric  the node has EXPECTED_FABRIC devices of its fabric (FABRIC_PROBE: efa = RDMA devices of
#           vendor 0x1d0f, mlx = RDMA devices of vendor 0x15b3, gvnic = PCI functions 1ae0:0042);
#           passes at once when FABRIC_PROBE is "none" (a pool without a GPU fabric)
# Binaries and the sysfs root can be redirected for tests: NVIDIA_SMI, DCGMI, NV_HOSTENGINE, SYSFS.
# After the checks the script sleeps, so the pod stays up and the results stay served.

set -u

RESULTS_DIR=${RESULTS_DIR:-/results}
DCGM_DIAG_LEVEL=${DCGM_DIAG_LEVEL:-1}
DCGM_PORT=${DCGM_PORT:-5557}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
DCGMI=${DCGMI:-dcgmi}
NV_HOSTENGINE=${NV_HOSTENGINE:-nv-hostengine}
SYSFS=${SYSFS:-/sys}
EXPECTED_WAIT_S=${EXPECTED_WAIT_S:-300}
STAY=${STAY:-1}

# result CHECK ok|fail DETAIL: write <check>.ok or <check>.fail atomically, remove the other.
result() {
  tmp="$RESULTS_DIR/.$1.tmp"
  printf '%s\n' "$3" > "$tmp"
  rm -f "$RESULTS_DIR/$1.ok" "$RESULTS_DIR/$1.fail"
  mv "$tmp" "$RESULTS_DIR/$1.$2"
  echo "preflight $1: $2: $3"
}

waited=0
while [ ! -s "$RESULTS_DIR/expected.env" ]; do
  if [ "$waited" -ge "$EXPECTED_WAIT_S" ]; then
    for c in gpus ecc dcgm fabric; do
      result "$c" fail "no expectations for this node after ${EXPECTED_WAIT_S}s (the pre-flight server could not read the node's pool)"
    done
    exit 1
  fi
  sleep 1
  waited=$((waited + 1))
done
# shellcheck disable=SC1091
. "$RESULTS_DIR/expected.env"
EXPECTED_GPUS=${EXPECTED_GPUS:-0}
EXPECTED_FABRIC=${EXPECTED_FABRIC:-0}
FABRIC_PROBE=${FABRIC_PROBE:-none}
if [ -n "${EXPECTATION_ERROR:-}" ]; then
  for c in gpus ecc dcgm fabric; do result "$c" fail "$EXPECTATION_ERROR"; done
  exit 1
fi

check_gpus() {
  if ! out=$("$NVIDIA_SMI" --query-gpu=index --format=csv,noheader 2>&1); then
    result gpus fail "nvidia-smi failed: $(echo "$out" | head -n 1)"
    return
  fi
  seen=$(printf '%s\n' "$out" | grep -c '^[[:space:]]*[0-9][0-9]*[[:space:]]*$')
  if [ "$seen" -eq "$EXPECTED_GPUS" ]; then
    result gpus ok "$seen of $EXPECTED_GPUS GPUs"
  else
    result gpus fail "nvidia-smi sees $seen GPUs, the node's pool has $EXPECTED_GPUS"
  fi
}

check_ecc() {
  if ! out=$("$NVIDIA_SMI" --query-gpu=index,ecc.errors.uncorrected.volatile.total,remapped_rows.pending,remapped_rows.failure \
      --format=csv,noheader 2>&1); then
    result ecc fail "nvidia-smi failed: $(echo "$out" | head -n 1)"
    return
  fi
  bad=$(printf '%s\n' "$out" | awk -F', *' '
    NF < 4 { next }
    {
      gpu = $1; dbe = $2; pending = $3; failed = $4
      if (dbe ~ /^[0-9]+$/ && dbe + 0 > 0) printf "GPU %s: %s uncorrectable ECC errors; ", gpu, dbe
      if (pending == "Yes") printf "GPU %s: row remap pending (reset needed); ", gpu
      if (failed == "Yes") printf "GPU %s: row remapping failed; ", gpu
    }')
  rows=$(printf '%s\n' "$out" | awk -F', *' 'NF >= 4' | wc -l | tr -d ' ')
  if [ "$rows" -eq 0 ]; then
    result ecc fail "nvidia-smi reported no GPU rows for the ECC query"
  elif [ -n "$bad" ]; then
    result ecc fail "${bad%; }"
  else
    result ecc ok "no uncorrectable ECC errors or row-remap faults on $rows GPUs"
  fi
}

check_dcgm() {
  "$NV_HOSTENGINE" -n -p "$DCGM_PORT" -b 127.0.0.1 >/dev/null 2>&1 &
  engine=$!
  tries=0
  until "$DCGMI" discovery --host "127.0.0.1:$DCGM_PORT" -l >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -ge 30 ] || ! kill -0 "$engine" 2>/dev/null; then
      kill "$engine" 2>/dev/null
      result dcgm fail "the DCGM host engine did not start"
      return
    fi
    sleep 1
  done
  out=$("$DCGMI" diag --host "127.0.0.1:$DCGM_PORT" -r "$DCGM_DIAG_LEVEL" 2>&1)
  rc=$?
  kill "$engine" 2>/dev/null
  wait "$engine" 2>/dev/null
  printf '%s\n' "$out"
  if [ "$rc" -eq 0 ]; then
    result dcgm ok "dcgmi diag -r $DCGM_DIAG_LEVEL passed"
  else
    failed=$(printf '%s\n' "$out" | grep -i 'fail' | head -n 3 | tr -s ' ' | tr '\n' ';')
    result dcgm fail "dcgmi diag -r $DCGM_DIAG_LEVEL exited $rc: ${failed:-see the pod log}"
  fi
}

# count_rdma VENDOR: RDMA devices (EFA, ConnectX) whose PCI vendor is VENDOR.
count_rdma() {
  n=0
  for d in "$SYSFS"/class/infiniband/*; do
    [ -e "$d/device/vendor" ] || continue
    [ "$(cat "$d/device/vendor")" = "$1" ] && n=$((n + 1))
  done
  echo "$n"
}

# count_pci VENDOR DEVICE: PCI functions with that vendor and device id (not network-namespaced).
count_pci() {
  n=0
  for d in "$SYSFS"/bus/pci/devices/*; do
    [ -e "$d/vendor" ] || continue
    [ "$(cat "$d/vendor")" = "$1" ] && [ "$(cat "$d/device")" = "$2" ] && n=$((n + 1))
  done
  echo "$n"
}

check_fabric() {
  case "$FABRIC_PROBE" in
    none) result fabric ok "this pool has no GPU fabric"; return ;;
    efa) seen=$(count_rdma 0x1d0f); what="EFA devices" ;;
    mlx) seen=$(count_rdma 0x15b3); what="RDMA NICs (ConnectX)" ;;
    gvnic) seen=$(count_pci 0x1ae0 0x0042); what="gVNIC NICs" ;;
    *) result fabric fail "unknown fabric probe '$FABRIC_PROBE'"; return ;;
  esac
  if [ "$seen" -eq "$EXPECTED_FABRIC" ]; then
    result fabric ok "$seen of $EXPECTED_FABRIC $what"
  else
    result fabric fail "found $seen $what, the node's pool has $EXPECTED_FABRIC"
  fi
}

check_gpus
check_ecc
check_dcgm
check_fabric

if [ "$STAY" = "1" ]; then
  while :; do sleep 3600; done
fi
