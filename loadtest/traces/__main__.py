"""Regenerate the shipped traces: `.venv/bin/python -m loadtest.traces`."""

from loadtest.traces import GENERATORS, NAMES, generate, path, save

for name in NAMES:
    save(generate(name))
    print(path(name))
for name, generator in GENERATORS.items():
    save(generator())
    print(path(name))
