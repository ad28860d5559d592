"""Every numeric decision of the model: the NumericPolicy and the primitives that read it."""

from jaxalign.numerics.policy import FIELDS, PRESETS, NumericPolicy
from jaxalign.numerics.dtypes import as_compute, as_param, cast, dtype
from jaxalign.numerics.params import cast_params

__all__ = ["FIELDS", "PRESETS", "NumericPolicy", "dtype", "cast", "as_compute", "as_param", "cast_params"]
