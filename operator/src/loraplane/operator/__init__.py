"""The loraplane Kubernetes operator (kopf): LoRAPool and LoRAAdapter.

Layout: `builders` (pure manifests), `status` (pure phase/condition logic), `cpclient`
(the control plane's HTTP API), `kube` (API access and login), `handlers` (thin kopf
handlers), `config` (settings), `cli` (`loraplane operator run`).
"""
