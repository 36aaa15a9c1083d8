"""The ``migratory`` command line: a thin Typer + Rich layer over the library."""
