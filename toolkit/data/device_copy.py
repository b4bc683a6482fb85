"""Host batches onto the training device without making the host wait for the GPU."""
from __future__ import annotations


def to_device(tensor, device):
    """A host tensor on `device`, queued behind the GPU's work instead of waiting for it.
    A copy from pageable memory synchronizes the stream: the host waits for every kernel
    launched before it, and the GPU then idles while the next forward is launched (once per
    micro-batch; under dynamic CP, once per forward, several a step). From pinned memory
    the copy is asynchronous. `device` None: the tensor as it is."""
    import torch

    if device is None:
        return tensor
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
