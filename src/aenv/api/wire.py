"""The bases of the API's JSON models: requests strict as E2B's decoding, responses that
drop `None` fields except the ones E2B always sends (`_KEEP_NULL`), so
`model_dump(by_alias=True)` is the wire shape wherever it is called."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

# A sandbox as E2B's two states show it.
ApiState = Literal["running", "paused"]


class ApiRequest(BaseModel):
    # Strict, as E2B's JSON decoding: `"timeout": "10"` or `"secure": "yes"` is a 400, not a
    # guess.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class ApiResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    # Wire names that stay in the JSON as `null` instead of being dropped.
    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: SerializerFunctionWrapHandler):
        # No return annotation on purpose: the JSON schema then stays the model's own.
        data = handler(self)
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in self._KEEP_NULL}
