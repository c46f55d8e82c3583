"""The real controllers beside the control plane, each built from its Go module and run with its webhooks: the Kubeflow training-operator v1, Trainer v2 with JobSet, and Kueue."""
