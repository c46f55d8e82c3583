"""What the real-node tests run in their pods (the operator image's python; no trainer image here)."""

from __future__ import annotations

from typing import Final

# Run by both pods of a two-worker training: rank 0 listens on MASTER_PORT, rank 1 finds it by
# MASTER_ADDR (cluster DNS: the training-operator's headless Service), from another node where
# there are two, and sends its devices; each prints what the kubelet's device manager gave it.
# Rank 0 ends only once rank 1 has reached it: a PyTorchJob succeeds with its master, and a
# worker whose master is gone never gets past its init container (the master's name resolves
# only while the master runs).
RENDEZVOUS: Final = """
import os, socket, time
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
devices = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
print(f"rank {rank} devices {devices}", flush=True)
if rank == 0:
    server = socket.create_server(("", port))
    server.settimeout(120)
    peer, address = server.accept()
    print(f"rank 1 devices {peer.recv(200).decode()} from {address[0]}", flush=True)
else:
    for attempt in range(240):
        try:
            connection = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    connection.sendall(devices.encode())
"""
