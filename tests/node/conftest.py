"""The real-node suite: what only a real node can show (cgroups, OOM, /dev/shm, the
securityContext enforced, projected tokens, SIGTERM), the operator from its image, and
`make cluster`. Its fixtures (nodes, scheduler, kube-proxy, CoreDNS) are
:mod:`support.node.fixtures`, shared with the end-to-end chain (tests/e2e_local).
"""
