"""The strict base models every nereus document is built from."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

#: The file-format version this release reads and writes.
FORMAT_VERSION = 1


class StrictModel(BaseModel):
    """A pydantic model that rejects unknown keys and loose types.

    Strict mode means `"8"` is not an integer and `1` is not a boolean: a value in a
    nereus file is taken exactly as written, or refused.
    """

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,
    )


class Document(StrictModel):
    """A top-level nereus file: it starts with `kind:` and `version:`."""

    KIND: ClassVar[str] = ""

    version: int = FORMAT_VERSION
    """File-format version; this release reads version 1."""

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version > FORMAT_VERSION:
            raise ValueError(
                f"version {version} is newer than this nereus reads ({FORMAT_VERSION}); "
                "upgrade nereus or write version 1"
            )
        if version < 1:
            raise ValueError(f"version must be {FORMAT_VERSION}, got {version}")
        return version
