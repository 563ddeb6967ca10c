"""`bastion template build NAME`: build a template's Python environment from its hashed lock."""

from __future__ import annotations

import argparse

from bastion.config import Config, TemplateConfig, add_config_option, load_config, resolve_config_path
from bastion.safety.errors import NotFound
from bastion.templates.env import BuiltEnv, build_template_env
from bastion.workbench.catalog import installed_packages


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `template` command to the top-level parser."""
    template = sub.add_parser("template", help="sandbox templates: build their Python environments")
    template_sub = template.add_subparsers(dest="template_command", required=True)
    build = template_sub.add_parser(
        "build", help="make a [[template]]'s python_env from its hashed lock (python_lock, or the one bastion ships)"
    )
    add_config_option(build)
    build.add_argument("name", help="the [[template]] name, e.g. python-data")


def _template(config: Config, name: str) -> TemplateConfig:
    found = next((t for t in config.template if t.name == name), None)
    if found is None:
        names = ", ".join(t.name for t in config.template) or "none"
        raise NotFound(f"no template {name!r} in the config (its [[template]] names: {names}): add it or fix the name")
    return found


def report(name: str, built: BuiltEnv) -> str:
    """One line saying what was built, from what, with how many packages."""
    verb = "built" if built.created else "brought up to its lock"
    count = len(installed_packages(built.path))
    packages = f"{count} package{'' if count == 1 else 's'}"
    return f"template {name!r}: {built.path} {verb} ({packages} from {built.lock})"


def run_template(args: argparse.Namespace) -> int:
    # The environment need not exist yet: loading the config must not refuse what this command makes.
    config = load_config(resolve_config_path(args.config), envs_built=False)
    template = _template(config, args.name)
    built = build_template_env(template, index_url=config.sandboxes.pip_index_url)
    print(report(args.name, built))
    return 0
