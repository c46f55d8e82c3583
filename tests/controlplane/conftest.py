"""The real control-plane suite: the session's etcd + kube-apiserver + kube-controller-manager
(support.fixtures), built from the Go modules beside this file (support.plane.controlplane).

test_api.py runs again against the oldest kube-apiserver the docs claim, on an etcd of its own,
built from ``tests/controlplane-oldest/go.mod`` and started for that module only.

Every test here is marked ``controlplane``. None skips: without ``go`` the binaries cannot be
built and the suite fails, saying so.
"""
