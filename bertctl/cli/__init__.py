"""The bertctl command line (Typer): one module per subcommand, assembled in ``app.py``.

Two process settings are made here, before any subcommand imports torch:

- the host allocator (see bertctl.allocator);
- ``OMP_WAIT_POLICY=PASSIVE`` unless the caller set it: OpenMP threads that spin while they wait
  for each other take the CPU from the threads they wait for when the machine has other work. On
  the 2-core development machine with two busy processes beside it, a tiny BERT's training step
  took 4.3 s with spinning threads against 0.16 s with passive ones (and 0.16 s on one thread).
  libgomp reads the variable once, when torch loads it.
"""
import os

from bertctl import allocator

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
allocator.configure()
