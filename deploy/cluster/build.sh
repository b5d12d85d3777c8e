#!/usr/bin/env bash
# Build the local cluster's binaries at the versions in versions.env, once.
#
# Binaries go to $LORAPLANE_CLUSTER_CACHE/<KUBERNETES_VERSION>/bin (default
# ~/.cache/loraplane/cluster/...), outside the repository. Each binary has a stamp
# recording what it was built from (version and wrapper go.mod/go.sum digest); a
# binary whose stamp matches is not rebuilt, so a warm run takes well under a second.
# Usage: build.sh [--print-bin-dir]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
cache="${LORAPLANE_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/loraplane/cluster}"
bin="$cache/$KUBERNETES_VERSION/bin"
if [[ "${1:-}" == "--print-bin-dir" ]]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$bin"
# One build at a time per cache: a second caller waits, then finds everything built.
exec 9>"$cache/.build.lock"
flock 9
rm -rf "$bin"/.install.* "$bin"/*.tmp  # left by a build that was killed

# Static, reproducible binaries; at most two packages compiled at once (2-core machines
# shared with other work), at low priority.
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -trimpath -buildvcs=false -p=${LORAPLANE_BUILD_JOBS:-2}"
export GOTOOLCHAIN=local

digest() { cat "$@" | sha256sum | cut -c1-16; }

# build NAME STAMP COMMAND...: run COMMAND (which writes $bin/NAME.tmp or installs into
# $tmpbin) unless $bin/NAME exists with the same stamp.
build() {
  local name="$1" stamp="$2"
  shift 2
  if [[ -x "$bin/$name" && "$(cat "$bin/.$name.stamp" 2>/dev/null)" == "$stamp" ]]; then
    return 0
  fi
  echo "build.sh: building $name ($stamp)" >&2
  local start=$SECONDS
  "$@"
  echo "$stamp" > "$bin/.$name.stamp"
  echo "build.sh: built $name in $((SECONDS - start)) s" >&2
}

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
build_date="$(date -u -d @0 +%Y-%m-%dT%H:%M:%SZ)"
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1"
  k8s_ldflags+=" -X $pkg.gitMinor=$k8s_minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done
k8s_stamp="$KUBERNETES_VERSION $(digest "$here/kubernetes/go.mod" "$here/kubernetes/go.sum")"

go_build_k8s() {  # go_build_k8s NAME
  (cd "$here/kubernetes" && nice go build -ldflags "-s -w $k8s_ldflags" -o "$bin/$1.tmp" "k8s.io/kubernetes/cmd/$1")
  mv "$bin/$1.tmp" "$bin/$1"
}
go_build_etcd() {
  (cd "$here/etcd" && nice go build -ldflags "-s -w" -o "$bin/etcd.tmp" .)
  mv "$bin/etcd.tmp" "$bin/etcd"
}
go_install() {  # go_install NAME PACKAGE@VERSION LDFLAGS
  local tmpbin
  tmpbin="$(mktemp -d "$bin/.install.XXXXXX")"
  GOBIN="$tmpbin" nice go install -ldflags "-s -w $3" "$2"
  mv "$tmpbin/$1" "$bin/$1"
  rmdir "$tmpbin"
}

build etcd "$ETCD_VERSION $(digest "$here/etcd/go.mod" "$here/etcd/go.sum" "$here/etcd/main.go")" go_build_etcd
build kube-apiserver "$k8s_stamp" go_build_k8s kube-apiserver
build kwok "$KWOK_VERSION" go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
build kubectl "$k8s_stamp" go_build_k8s kubectl
build kube-controller-manager "$k8s_stamp" go_build_k8s kube-controller-manager
build kube-scheduler "$k8s_stamp" go_build_k8s kube-scheduler
build helm "$HELM_VERSION" go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
echo "$bin"
