"""What every section of the config tree shares: its base model, the error a bad file or override
raises, and the bounded numbers its fields use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names key, value and reason."""


class Section(BaseModel):
    """A section of the tree: an unknown key is an error, not a silently ignored typo, and so is
    an assignment that breaks a field's bounds."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
