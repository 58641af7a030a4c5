"""The bertctl command line (Typer): one module per subcommand, assembled in ``app.py``.

Two process settings are made here, before any subcommand imports torch:

- the host allocator (see bertctl.allocator);
- ``GOMP_SPINCOUNT=1000`` unless the caller set it or ``OMP_WAIT_POLICY``: OpenMP threads that spin
  long while they wait for each other take the CPU from the threads they wait for when the machine has
  other work, and short spins cost next to nothing on a quiet one (the setting of
  benchmarks/results/pretrain-default-job-cpu-loaded.json). libgomp reads it once, when torch loads.
"""
import os

from bertctl import allocator

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
allocator.configure()
