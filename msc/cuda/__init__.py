"""CUDA backend: plans rendered to CUDA C++ (templates/) and compiled with
NVRTC through cuda-python (no GPU or driver needed), and the runtime that
launches them on torch CUDA tensors (``Communicator``, msc.cuda.runtime;
needs a GPU, and imports torch and the driver only when used)."""
from msc.cuda.codegen import DTYPES, OPS, KernelLayout, render
from msc.cuda.compiler import CompiledKernel, cache_dir, compile, nvrtc_compile
from msc.cuda.device import driver_available
from msc.cuda.diagnose import BrokenCommunicatorError, DeviceTimeoutError
from msc.cuda.runtime import Communicator

__all__ = ["DTYPES", "OPS", "BrokenCommunicatorError", "Communicator", "CompiledKernel", "DeviceTimeoutError",
           "KernelLayout", "cache_dir", "compile", "driver_available", "nvrtc_compile", "render"]
