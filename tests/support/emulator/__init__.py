"""The Kubernetes API emulator (kmock with the semantics the operator relies on) and the cluster the tests/emulated suite drives through it: a stand-in, for paths that need no real server."""
