"""gputrain: the distributed PyTorch trainer that runs in every GpuTraining pod.

Importing the package itself is cheap and imports no torch, so the operator can import
:mod:`gputrain.contract` without the training stack installed.
"""
