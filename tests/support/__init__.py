"""What the suites share, laid out by role.

At the top, for every suite: ``paths`` (where things are), ``waiting`` (polling with a timeout
that names what never came), ``specs`` (GpuTraining documents), ``samples`` (what stand-in
trainers report, what kubectl shows), ``cost`` (CPU seconds of one call), ``training`` (real
local training runs and the trainer gate in ``trainer_hold/``) and ``fixtures`` (the session's
shared fixtures, loaded as a plugin by tests/conftest.py).

By role: ``plane`` (the real control plane, the Go builds, its client, a fault proxy),
``controllers`` (the real Kubeflow and Kueue controllers with their webhooks), ``emulator`` (the
API emulator: a stand-in, for the tests/emulated suite), ``schemas`` (validation against
upstream schemas), ``tools`` (helm, Mermaid, the operator's option parsing), ``node`` (real
nodes: containerd, runc, the CNI bridge, kubelet, kube-scheduler, kube-proxy, CoreDNS, and their
fixtures), ``images`` (the images built or assembled here), and ``chain`` and ``cluster`` (what
the end-to-end chain and `make cluster` stand on).

Imports go from the roles to the top, never between roles the other way round: ``plane``
needs nothing of ``controllers``; ``emulator`` nothing of the real plane but its kubectl.
"""
