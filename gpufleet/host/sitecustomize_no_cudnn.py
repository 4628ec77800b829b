"""002's overlay for the GLM-specific vLLM image: cuDNN off, as the recipe says ("A
sitecustomize.py overlay disables cuDNN to avoid a convolution crash during multimodal
initialization with the GLM-specific vLLM image").

The image runtime mounts this file as sitecustomize.py into the engine containers of the
targets that run that image (PYTHONPATH names its directory first). Python imports it at
start-up; it waits for torch to be imported by the engine, then sets
torch.backends.cudnn.enabled = False, so processes that never import torch pay nothing.
Standard library only; Python 3.8 and newer.
"""

import importlib.abc
import importlib.util
import sys


class _CudnnOff(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # find the real torch, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.backends.cudnn.enabled = False

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _CudnnOff) for f in sys.meta_path):
    sys.meta_path.insert(0, _CudnnOff())
