"""CUDA backend: plans rendered to CUDA C++ (templates/) and compiled with
NVRTC through cuda-python. Compiling needs no GPU or driver; launching does
(msc.cuda.runtime)."""
from msc.cuda.codegen import DTYPES, OPS, KernelLayout, render

__all__ = ["DTYPES", "OPS", "KernelLayout", "render"]
