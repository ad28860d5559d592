"""The typed values a `NumericPolicy` field holds, each parsed once from its text (`"tiled:8"` -> `Tiled(8)`).

Every value prints as the text it was parsed from (`str`), so a policy's string form, its `to_dict()` and the
JSON that routing records and golden files store are unchanged by the types; `repr` is that text quoted, so error
messages and a policy's repr read as the text too. The enum members are `str`s: `DType.bf16 == "bf16"`, and a
value can be compared with its text anywhere; the parameterised values compare equal to their text as well
(`Tiled(8) == "tiled:8"`).

- `DType`: f32 | bf16 | f16.
- `DotAlgorithm(name)`: a `lax.DotAlgorithmPreset` named by a matmul field.
- `Tiled(rows)`, `Pallas(bm, bn, bk)`: the batch-invariant matmul kernels (`"xla"` stays the text "xla").
- `Chunked(size)`: chunked attention (`"full"` stays "full").
- `Capacity(factor)`: token-dropping expert dispatch (the other dispatches stay their text).
- `Fp8Blocks(rows, cols)`: `e4m3:RxC`, FP8 weights in [R, C] blocks of [K, N] (`"none"` stays "none").
- `Fp8Tiles(size)`: `e4m3:B`, FP8 activations in 1xB tiles along the contraction (`"none"` stays "none").
Each parser returns None for text that is not of its form; `NumericPolicy` turns that into an error naming the
field and what it allows.
"""

from __future__ import annotations

import dataclasses
import enum

from jax import lax

DOT_PRESETS = tuple(name for name in dir(lax.DotAlgorithmPreset) if not name.startswith("_"))


class DType(enum.StrEnum):
    """A policy dtype name."""

    f32 = "f32"
    bf16 = "bf16"
    f16 = "f16"

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def is_low_precision(self) -> bool:
        """Narrower than float32 (bf16 or f16)."""
        return self is not DType.f32

    @classmethod
    def parse(cls, text: object) -> "DType | None":
        """The member named `text` (a member passes through), or None."""
        return cls(text) if isinstance(text, str) and text in cls._value2member_map_ else None


class _PolicyValue:
    """Shared by the parameterised values: printed (and repr'd) as their policy text, and equal to it (the text
    is canonical, so equal text means equal fields)."""

    def __repr__(self) -> str:
        return repr(str(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) or type(other) is type(self):
            return str(self) == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class DotAlgorithm(_PolicyValue):
    """A `lax.DotAlgorithmPreset` passed to XLA as the algorithm of every product (matmul / matmul_bwd)."""

    name: str

    def __str__(self) -> str:
        return self.name

    @property
    def preset(self) -> lax.DotAlgorithmPreset:
        """The JAX enum member."""
        return getattr(lax.DotAlgorithmPreset, self.name)

    @classmethod
    def parse(cls, text: object) -> "DotAlgorithm | None":
        """`DotAlgorithm(text)` when `text` names a preset, else None."""
        return cls(text) if isinstance(text, str) and text in DOT_PRESETS else None


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Tiled(_PolicyValue):
    """`tiled:T`: fixed [T, K] row tiles (batch invariant). `probed:T` (`probed=True`): a plain product on rows
    padded to a bucket wherever a probe of this backend proved the plain product row-invariant for the shape
    (`numerics/invariance.py`), and the [T, K] tiles elsewhere (and for grouped products and attention)."""

    rows: int
    probed: bool = False

    def __str__(self) -> str:
        return f"{'probed' if self.probed else 'tiled'}:{self.rows}"

    @classmethod
    def parse(cls, text: object) -> "Tiled | None":
        """`Tiled(T)` of `tiled:T`, `Tiled(T, probed=True)` of `probed:T` (T a positive int), else None."""
        for prefix, probed in (("tiled:", False), ("probed:", True)):
            rows = _positive_suffix(text, prefix, int)
            if rows is not None:
                return cls(rows, probed)
        return None


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Pallas(_PolicyValue):
    """`pallas:BMxBNxBK`: the tiled semantics in Pallas kernels, each block a power of two >= 8."""

    bm: int
    bn: int
    bk: int

    def __str__(self) -> str:
        return f"pallas:{self.bm}x{self.bn}x{self.bk}"

    @property
    def blocks(self) -> tuple[int, int, int]:
        """(BM, BN, BK)."""
        return (self.bm, self.bn, self.bk)

    @classmethod
    def parse(cls, text: object) -> "Pallas | None":
        """`Pallas(BM, BN, BK)` of `pallas:BMxBNxBK`, else None."""
        if not isinstance(text, str) or not text.startswith("pallas:"):
            return None
        parts = text[len("pallas:"):].split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        blocks = [int(p) for p in parts]
        if not all(b >= 8 and b & (b - 1) == 0 for b in blocks):
            return None
        return cls(*blocks)


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Chunked(_PolicyValue):
    """`chunked:C`: online softmax over fixed chunks of C keys."""

    size: int

    def __str__(self) -> str:
        return f"chunked:{self.size}"

    @classmethod
    def parse(cls, text: object) -> "Chunked | None":
        """`Chunked(C)` of `chunked:C` (C a positive int), else None."""
        size = _positive_suffix(text, "chunked:", int)
        return None if size is None else cls(size)


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Capacity(_PolicyValue):
    """`capacity:F`: per-expert buffers of F*tokens*k/experts rows, overflow dropped."""

    factor: float

    def __str__(self) -> str:
        return f"capacity:{_number_text(self.factor)}"

    @classmethod
    def parse(cls, text: object) -> "Capacity | None":
        """`Capacity(F)` of `capacity:F` (F a positive float), else None."""
        factor = _positive_suffix(text, "capacity:", float)
        return None if factor is None else cls(factor)


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Fp8Blocks(_PolicyValue):
    """`e4m3:RxC`: a weight [K, N] stored as float8_e4m3fn in [R, C] blocks (R along K, C along N), one scale
    per block (`jaxalign.numerics.fp8`)."""

    rows: int
    cols: int

    def __str__(self) -> str:
        return f"e4m3:{self.rows}x{self.cols}"

    @classmethod
    def parse(cls, text: object) -> "Fp8Blocks | None":
        """`Fp8Blocks(R, C)` of `e4m3:RxC` (positive ints), else None."""
        if not isinstance(text, str) or not text.startswith("e4m3:"):
            return None
        parts = text[len("e4m3:"):].split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            return None
        return cls(int(parts[0]), int(parts[1]))


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Mxfp4(_PolicyValue):
    """`mxfp4`: a weight [K, N] in OCP Microscaling v1.0 MXFP4: float4_e2m1fn elements, one float8_e8m0fnu
    (power-of-two) scale per 32 consecutive elements along K (`jaxalign.numerics.lowbit`)."""

    def __str__(self) -> str:
        return "mxfp4"

    @property
    def group(self) -> int:
        """Elements per scale along the contraction (the spec's block size k = 32)."""
        return 32

    @classmethod
    def parse(cls, text: object) -> "Mxfp4 | None":
        """`Mxfp4()` of `mxfp4`, else None."""
        return cls() if text == "mxfp4" else None


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Int4Groups(_PolicyValue):
    """`int4:G`: a weight [K, N] as signed 4-bit integers with one scale per G consecutive elements along K,
    symmetric (Kimi-style W4A16; `jaxalign.numerics.lowbit`)."""

    group: int

    def __str__(self) -> str:
        return f"int4:{self.group}"

    @classmethod
    def parse(cls, text: object) -> "Int4Groups | None":
        """`Int4Groups(G)` of `int4:G` (G a positive int), else None."""
        if not isinstance(text, str) or not text.startswith("int4:") or not text[5:].isdigit():
            return None
        group = int(text[5:])
        return cls(group) if group > 0 else None


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Fp8Tiles(_PolicyValue):
    """`e4m3:B`: an activation [..., K] rounded to float8_e4m3fn in 1xB tiles along K, one scale per tile,
    computed from the tile itself at run time (`jaxalign.numerics.fp8`)."""

    size: int

    def __str__(self) -> str:
        return f"e4m3:{self.size}"

    @classmethod
    def parse(cls, text: object) -> "Fp8Tiles | None":
        """`Fp8Tiles(B)` of `e4m3:B` (B a positive int), else None."""
        if not isinstance(text, str) or not text.startswith("e4m3:") or not text[5:].isdigit():
            return None
        size = int(text[5:])
        return cls(size) if size > 0 else None


def _positive_suffix(text: object, prefix: str, kind: type):
    if not isinstance(text, str) or not text.startswith(prefix):
        return None
    try:
        number = kind(text[len(prefix):])
    except ValueError:
        return None
    return number if number > 0 else None


def _number_text(value: float) -> str:
    """The shortest text that parses back to `value` ("2" for 2.0, "1.25")."""
    return str(int(value)) if value.is_integer() else repr(value)
