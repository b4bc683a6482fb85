"""What oneDNN (torch's CPU kernels) runs on this CPU, asked through a private torch op
cited in `versions.torch_version.PRIVATE_CALLS`."""
from __future__ import annotations


def cpu_fp16_supported() -> bool:
    """Whether oneDNN runs fp16 on this CPU (AVX512-FP16 or AMX-FP16): DeepSpeed's CPU
    accelerator asks the same question and refuses fp16 without it."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the query: DeepSpeed says no too
        return False
