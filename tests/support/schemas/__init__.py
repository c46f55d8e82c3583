"""Validation against upstream schemas read from tests/reference: our CRD's structural schema and CEL, Kubeflow's CRDs and webhook rules."""
