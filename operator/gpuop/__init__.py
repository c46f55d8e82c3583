"""gpuop: the GPU training operator.

Layers, importing only downwards: ``cli`` -> ``crd``/``render`` -> ``spec``/``status`` ->
``schema`` -> ``quantity``. The operator's cluster side (Kopf handlers, the API client)
sits on top and is the only code that talks to Kubernetes. Nothing here imports torch.
"""
