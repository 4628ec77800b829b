"""gpufleet lab stand-in for PyTorch @VERSION@: the part of its API that fab acceptance
measures with (tensors on the simulated GPUs, torch.cuda, torch.distributed), answering
from the lab host's simulated hardware (/etc/gpufleet-lab/hw.json) and the faults injected
into it (/var/lib/gpufleet-lab/gpu-faults.json).

Work runs on a simulated GPU timeline, asynchronously as on a real GPU: an operation
takes the time the profile's figures give it (memory writes at gpu.mem_write_gbs, bf16
matmul at gpu.tflops_bf16, all_reduce at the NVLink bandwidth of the group's slowest GPU),
and torch.cuda.synchronize() or .item() waits until the timeline is done. Tensor contents
are one value per tensor (plus words a memory fault corrupts), which is all the
acceptance checks read. Anything else is not here.
"""

from . import backends, cuda  # noqa: F401
from ._tensor import (  # noqa: F401
    Generator,
    Tensor,
    bfloat16,
    empty,
    float16,
    float32,
    int32,
    isfinite,
    randn,
)
from ._tensor import bool_ as bool  # noqa: F401, A001

__version__ = "@VERSION@"
