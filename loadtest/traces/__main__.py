"""Regenerate the shipped traces: `.venv/bin/python -m loadtest.traces`."""

from loadtest.traces import NAMES, generate, path, save

for name in NAMES:
    save(generate(name))
    print(path(name))
