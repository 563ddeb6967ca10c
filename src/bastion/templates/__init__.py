"""Sandbox templates' Python environments, and the locks bastion ships for them (package data).

`_pip` is the dangerous layer (it starts the system Python and pip on the host); `env` checks the
folder and picks the lock before calling it. tests/test_contracts.py checks who imports `_pip`.
"""

from bastion.templates._pip import SYSTEM_PYTHON
from bastion.templates.env import BuiltEnv, build_template_env, builtin_lock_names, check_lock, template_lock

__all__ = ["SYSTEM_PYTHON", "BuiltEnv", "build_template_env", "builtin_lock_names", "check_lock", "template_lock"]
