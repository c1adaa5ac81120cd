"""The kernel lab: microbenchmarks of the experimental kernels, launch-config sweeps, profiler
traces and step profiles, GPU power readings, compiled-gradient checks and peak-memory probes.
"""
