"""The real control-plane suite: the session's etcd + kube-apiserver + kube-controller-manager
(support.fixtures), built from the Go modules beside this file (support.plane.controlplane).

Every test here is marked ``controlplane``. None skips: without ``go`` the binaries cannot be
built and the suite fails, saying so.
"""
