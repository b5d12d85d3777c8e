"""A real Kubernetes control plane on one machine, for development and the cluster tests.

`loraplane cluster up` starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake GPU nodes) on loopback, built from the Go module proxy at
the versions in `deploy/cluster/versions.env`, plus a local pod runner that runs the
command of pods labelled `loraplane.io/local-run: "true"` as local processes bound to
their loopback pod IPs. See docs/cluster.md.

Modules: `layout` (where things live), `pki` (certificates and keys), `components`
(the command line of each process), `processes` (start and stop by PID), `cluster`
(up, down, status), `runner` (the local pod runner), `podenv` (a pod's environment and
`$(VAR)` expansion), `cli` (the typer commands).
"""
