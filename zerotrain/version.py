"""The package's version: its own module, so that the parts that record it (a checkpoint's trainer state, a
merge's metadata) do not import the package root, which imports them back through the engine."""
__version__ = "0.1.0"
