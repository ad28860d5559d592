"""Every numeric decision of the model: the NumericPolicy and the primitives that read it."""

from jaxalign.numerics.policy import FIELDS, PRESETS, NumericPolicy
from jaxalign.numerics.dtypes import as_compute, as_param, cast, cast_params, dtype

__all__ = ["FIELDS", "PRESETS", "NumericPolicy", "dtype", "cast", "as_compute", "as_param", "cast_params"]
