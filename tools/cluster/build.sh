#!/usr/bin/env bash
# Build the local control plane's binaries from the Go modules pinned under tools/cluster/go/ into build/cluster/bin/.
#   bash tools/cluster/build.sh            build what is missing or stale
# Each binary is rebuilt only when its module's go.mod or go.sum changes: build/cluster/bin/.NAME.<hash> is the stamp.
# Go's own module and build caches ($(go env GOMODCACHE), $(go env GOCACHE)) make a rebuild after a pin change quick.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin="$root/build/cluster/bin"
mkdir -p "$bin"
# One build at a time (parallel test workers, a second shell): the others wait here, then find the stamps.
exec 9>"$bin/.lock"
flock 9
command -v go >/dev/null || { echo "cluster build: the Go toolchain (go) is not on PATH; install Go 1.26 or newer" >&2; exit 2; }
retry() {  # retry WHAT COMMAND...: a command that downloads, run again after a failure (a dropped connection), 3 times
  local what=$1 try; shift
  for try in 1 2 3; do
    "$@" && return 0
    [ "$try" = 3 ] && return 1
    echo "cluster build: $what failed (attempt $try of 3): trying again in 30 s" >&2
    sleep 30
  done
}
# The version each server reports: the pinned module's own version, so `kubectl version` tells the truth.
kube_version=$(cd "$here/go/kubernetes" && retry "reading the kubernetes module's version" go list -m -f '{{.Version}}' k8s.io/kubernetes)
build() {  # build MODULE_DIR OUTPUT PACKAGE [LDFLAGS]
  local mod=$1 out=$2 pkg=$3 ldflags=${4:-}
  local hash; hash=$(find "$here/go/$mod" -maxdepth 1 -type f \( -name 'go.*' -o -name '*.go' \) -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)
  if [ -x "$bin/$out" ] && [ -e "$bin/.$out.$hash" ]; then return 0; fi
  echo "cluster build: $out from $pkg ($mod module)" >&2
  local start; start=$(date +%s)
  # The sources the package needs (only those: `go mod download` would fetch every module of the build list).
  (cd "$here/go/$mod" && retry "downloading what $out needs" env CGO_ENABLED=0 go list -deps "$pkg" >/dev/null)
  (cd "$here/go/$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$bin/$out.tmp" "$pkg")
  mv "$bin/$out.tmp" "$bin/$out"
  rm -f "$bin/.$out".* && touch "$bin/.$out.$hash"
  echo "cluster build: $out built in $(( $(date +%s) - start )) s" >&2
}
kv="-X k8s.io/component-base/version.gitVersion=$kube_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$kube_version" | cut -d. -f2)"
build etcd etcd .
build kubernetes kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$kv"
build kubernetes kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$kv"
build kubernetes kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$kv"
build kueue kueue sigs.k8s.io/kueue/cmd/kueue
build jobset jobset sigs.k8s.io/jobset
build kwok kwok sigs.k8s.io/kwok/cmd/kwok
