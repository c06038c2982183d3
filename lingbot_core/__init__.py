"""LingBot-World v2 serving core.

Importing the package prepares the process before the first large tensor and the first compile, for every
entry point (the app, the offline command, the examples, the benchmarks, the tests import it first):
the C allocator keeps freed memory (lingbot_core/process/allocator.py) and torch.compile's kernels go to a cache
that persists across runs (lingbot_core/process/compile_cache.py).
"""

from lingbot_core.process.allocator import keep_freed_memory
from lingbot_core.process.compile_cache import keep_compiled_kernels

keep_freed_memory()
keep_compiled_kernels()
