"""Developer tools of the project (not part of the installed package): `python -m tools.mutate`."""
