"""The bertctl command line (Typer): one module per subcommand, assembled in ``app.py``.

The host allocator is tuned here, before any subcommand imports torch (see bertctl.allocator).
"""
from bertctl import allocator

allocator.configure()
