"""torch.cuda on the lab's simulated GPUs."""

from . import _hw

_current = [0]


def is_available():
    return bool(_hw.visible())


def device_count():
    return len(_hw.visible())


def _physical(device=None):
    index = _current[0] if device is None else int(device)
    vis = _hw.visible()
    if not 0 <= index < len(vis):
        raise RuntimeError("CUDA error: invalid device ordinal")
    return vis[index]


def set_device(device):
    _physical(device)
    _current[0] = int(device)


def current_device():
    return _current[0]


def get_device_name(device=None):
    _physical(device)
    return _hw.hw()["gpu"]["name"]


def mem_get_info(device=None):
    _physical(device)
    spec = _hw.hw()["gpu"]
    total = int(spec["memory_mib"]) * 2**20
    return total - int(spec.get("reserved_mib", 0)) * 2**20, total


def synchronize(device=None):
    from .distributed import _settle

    _settle()
    _hw.TIMELINE.wait()


def empty_cache():
    pass
