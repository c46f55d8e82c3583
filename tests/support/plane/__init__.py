"""The real control plane (etcd, kube-apiserver, kube-controller-manager built from their Go modules), the Go builds behind it, the client the tests use on it, and a fault-injecting proxy."""
