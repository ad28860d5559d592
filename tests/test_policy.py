"""NumericPolicy: presets, string round trip, diff, validation."""

import dataclasses

import pytest

from jaxalign.numerics import FIELDS, PRESETS, NumericPolicy

REQUIRED = ("fp32", "train-bf16", "serve-bf16", "aligned-bf16", "fp16", "hf-eager-bf16", "hf-grouped-bf16")


def test_required_presets_exist_and_round_trip():
    for name in REQUIRED:
        policy = NumericPolicy.preset(name)
        assert NumericPolicy.parse(str(policy)) == policy
        assert NumericPolicy.parse(name) == policy
        hash(policy)


def test_string_names_every_field():
    text = str(NumericPolicy())
    assert [item.split("=")[0] for item in text.split(",")] == [f.key for f in FIELDS.values()]
    assert len(FIELDS) == len(dataclasses.fields(NumericPolicy))


def test_preset_with_overrides():
    p = NumericPolicy.parse("aligned-bf16, kernel=xla,attn=chunked:32")
    assert p.matmul_kernel == "xla" and p.attention_chunk == 32
    assert p.diff(NumericPolicy.preset("aligned-bf16")) == [("matmul_kernel", "xla", "tiled:8"),
                                                             ("attention", "chunked:32", "full")]
    assert NumericPolicy.parse("compute=bf16,param=bf16").compute_dtype == "bf16"
    # long field names are accepted too
    assert NumericPolicy.parse("fp32,combine_order=expert").combine_order == "expert"


def test_presets_are_distinct():
    values = list(PRESETS.values())
    assert len(set(values)) == len(values)


@pytest.mark.parametrize("text, needle", [
    ("compute=fp8", "compute"),
    ("kernel=tiled:0", "tiled:T"),
    ("kernel=tiled:x", "kernel"),
    ("attn=chunked:-4", "chunked:C"),
    ("dispatch=capacity:0", "capacity:F"),
    ("combine=random", "slot|expert|dense"),
    ("reduce=pairwise", "xla|tree"),
    ("warp=9", "allowed keys"),
    ("nonsense-preset", "allowed: fp32"),
    ("fp32,compute", "key=value"),
    ("compute=bf16,compute=f32", "twice"),
    ("", "non-empty"),
    ("matmul=bf16", "accumulates below"),
    ("dispatch=gather,kernel=tiled:8", "gather"),
])
def test_invalid_policies_name_the_problem(text, needle):
    with pytest.raises(ValueError, match=needle.replace("|", r"\|").replace("(", r"\(")):
        NumericPolicy.parse(text)


def test_dot_algorithm_preset_names_accepted():
    assert NumericPolicy.parse("matmul=BF16_BF16_F32").matmul_acc == "BF16_BF16_F32"
