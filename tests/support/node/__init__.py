"""A real Kubernetes node for the tests, on this machine, without Docker: containerd v2 + runc +
the CNI bridge and host-local plugins + kubelet v1.35 (the apiserver's version), plus the real
kube-scheduler, against the control plane of :mod:`support.plane.controlplane`. Pods created
through the API run as containers in cgroups, with the kubelet's volumes, tokens and status.

- :mod:`.binaries`: the Go builds (containerd, shim, ctr, CNI plugins; runc with cgo; kubelet
  and kube-scheduler from the apiserver's module graph), cached in ~/.cache/gpuop.
- :mod:`.images`: the pause image and a shell image, stand-ins assembled here as OCI archives
  (no registry is reachable), from ``pause.c`` and the host's dash and coreutils.
- :mod:`.containerd`, :mod:`.kubelet`: one node's daemons, every file under its work directory.
- :mod:`.node`: a node's start and stop (drain, then daemons, then a sweep), and the scheduler.
- :mod:`.hoststate`: what a node leaves on the machine (processes, mounts, cgroups, links),
  found and removed.
- :mod:`.process`: starting daemons that die with their parent, and finding a node's shims.

- :mod:`.pool`: scheduler, two nodes, kube-proxy and CoreDNS started together, images on both:
  what `make cluster` and the end-to-end chain run.
- :mod:`.fixtures`: the same pieces one module-scoped fixture at a time, for the real-node suite.

Needs root. Every pod of the suites runs here; the node agent, a process per container that the
chain ran on before, is gone.
"""
