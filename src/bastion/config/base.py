"""The shared base of bastion.toml's models: the frozen, closed `Model` (the env check is `safety.environment`).

Private. The section modules (`bastion._config_*`) import from here, never from `bastion.config`,
which imports them all; everything public is imported from `bastion.config`.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict

ID_PATTERN: Final = r"^[a-z][a-z0-9_-]{0,31}$"


class Model(BaseModel):
    # TOML has `nan` and `inf`: a NaN limit passes every `<=` check and, as a timer, upsets the event loop's.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
