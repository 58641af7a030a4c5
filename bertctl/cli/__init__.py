"""The bertctl command line (Typer): one module per subcommand, assembled in ``app.py``.

Two process settings are made here, before any subcommand imports torch:

- the host allocator (see bertctl.allocator);
- ``GOMP_SPINCOUNT=1000`` unless the caller set it or ``OMP_WAIT_POLICY``: OpenMP threads that spin
  long while they wait for each other take the CPU from the threads they wait for when the machine
  has other work. A tiny BERT's training step on the 2-core development machine, two threads:
  quiet, 31 ms with libgomp's default spinning and 32 ms with 1000 spins; beside two busy
  processes, 4.3 s with the default against 77-80 ms with 1000 spins (``OMP_WAIT_POLICY=PASSIVE``:
  53-94 ms there, but 43 ms on the quiet machine). libgomp reads the variable once, when torch loads it.
"""
import os

from bertctl import allocator

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
allocator.configure()
