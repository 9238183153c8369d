"""Prints each dependency of `pyproject.toml` pinned to its lower bound
(`jax>=0.10.0,<0.11` gives `jax==0.10.0`), for the CI run on the oldest versions."""

import pathlib
import re
import tomllib


root = pathlib.Path(__file__).parent.parent
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
pins = []
for dependency in project["dependencies"]:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+).*", dependency)
    if match is None:
        raise SystemExit(f"pyproject.toml: no lower bound in {dependency!r}")
    pins.append(f"{match.group(1)}=={match.group(2)}")
print(" ".join(pins))
