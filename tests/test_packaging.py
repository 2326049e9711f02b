"""The install files agree with each other and with the README."""

import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def _conda_requirements() -> dict[str, Requirement]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    found = {}
    for dep in env["dependencies"]:
        entries = dep["pip"] if isinstance(dep, dict) else [dep]
        for entry in entries:
            if entry.startswith("-e") or entry.split(">=")[0] in ("python", "pip"):
                continue
            req = Requirement(entry)
            found[req.name.lower()] = req
    return found


def test_environment_yml_matches_pyproject():
    pyproject = _pyproject_requirements()
    conda = _conda_requirements()
    assert set(conda) == set(pyproject), (
        f"only in pyproject.toml: {sorted(set(pyproject) - set(conda))}; "
        f"only in environment.yml: {sorted(set(conda) - set(pyproject))}"
    )
    for name, req in pyproject.items():
        assert str(conda[name].specifier) == str(req.specifier), f"{name}: {conda[name]} vs {req}"
        assert conda[name].marker == req.marker, f"{name}: markers differ"


def test_ci_constraints_satisfy_pyproject():
    pyproject = _pyproject_requirements()
    for line in (ROOT / "constraints" / "ci.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, version = line.split("==")
        assert name.lower() in pyproject, f"constraints/ci.txt pins {name}, which pyproject.toml does not ask for"
        assert version in pyproject[name.lower()].specifier, f"{line} violates pyproject's {pyproject[name.lower()]}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
    assert "make lab" in readme
