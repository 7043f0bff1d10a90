"""tierflow's CPU optimizer: ``tierflow.optim.CPUAdamW`` (adamw.py) and its parts: the C++ gradient stream's
Python side (streaming.py), the share stepped on the GPU (gpu_share.py), the states' space and NVMe faults
(nvme_states.py), and the user's clip seen by the stream (clip.py)."""

from .adamw import CPUAdamW
from .nvme_states import LOST_STATE

__all__ = ["CPUAdamW", "LOST_STATE"]
