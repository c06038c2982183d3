"""The process: memory, threads, compiled kernels, precision, start-up and its work folder."""
