"""LingBot-World v2 serving core.

Importing the package sets the C allocator to keep freed memory (lingbot_core/allocator.py): it must
happen before the first large tensor, and every entry point (the app, the offline command, the examples,
the benchmarks, the tests) imports this package first.
"""

from .allocator import keep_freed_memory

keep_freed_memory()
