"""NumericPolicy: presets, string round trip, diff, validation."""

import dataclasses
import json

import pytest
from jax import lax

from jaxalign.numerics import FIELDS, PRESETS, NumericPolicy
from jaxalign.numerics.policy_values import Capacity, Chunked, DotAlgorithm, DType, Pallas, Tiled

REQUIRED = ("fp32", "train-bf16", "serve-bf16", "aligned-bf16", "fp16", "hf-eager-bf16", "hf-grouped-bf16", "hf-fp32")


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
    ("index_ties=higher-slot", "lower-slot|torch-cpu"),
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


def test_fields_hold_typed_values_parsed_once():
    p = NumericPolicy.parse("aligned-bf16,attn=chunked:16,dispatch=capacity:1.25,matmul_bwd=BF16_BF16_F32_X3")
    assert p.compute_dtype is DType.bf16 and p.norm_dtype is DType.f32
    assert p.matmul_kernel == Tiled(8) and p.attention == Chunked(16) and p.dispatch == Capacity(1.25)
    assert p.matmul_bwd == DotAlgorithm("BF16_BF16_F32_X3")
    assert p.matmul_bwd.preset is lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    assert NumericPolicy.parse("kernel=pallas:8x16x16").matmul_kernel == Pallas(8, 16, 16)
    # the derived properties other modules read
    assert (p.tile_rows, p.attention_chunk, p.capacity_factor, p.pallas_blocks) == (8, 16, 1.25, None)
    assert NumericPolicy.parse("kernel=pallas:8x16x16").pallas_blocks == (8, 16, 16)
    # plain choices stay str; typed values equal (and hash like) their text, so callers may compare either way
    assert type(p.reduction) is str and p.reduction == "tree"
    assert p.matmul_kernel == "tiled:8" and hash(p.matmul_kernel) == hash("tiled:8") and p.compute_dtype == "bf16"
    assert p.matmul_kernel != Tiled(16) and p.matmul_kernel != Chunked(8) and p.matmul_kernel != "tiled:16"


def test_text_and_typed_values_build_the_same_policy():
    typed = NumericPolicy(compute_dtype=DType.bf16, param_dtype=DType.bf16, matmul_kernel=Tiled(8),
                          attention=Chunked(16), dispatch=Capacity(2.0))
    text = NumericPolicy(compute_dtype="bf16", param_dtype="bf16", matmul_kernel="tiled:8", attention="chunked:16",
                         dispatch="capacity:2")
    assert typed == text and hash(typed) == hash(text) and str(typed) == str(text)
    assert typed.replace(matmul_kernel="xla") == text.replace(matmul_kernel="xla")
    assert NumericPolicy().replace(matmul_kernel="tiled:4").matmul_kernel == Tiled(4)
    with pytest.raises(ValueError, match=r"matmul_kernel \(kernel\) = 'tiled:0' is not allowed"):
        NumericPolicy().replace(matmul_kernel="tiled:0")
    with pytest.raises(ValueError, match="compute_dtype"):
        NumericPolicy(compute_dtype=8)


def test_text_forms_keep_strings():
    p = NumericPolicy.parse("aligned-bf16,attn=chunked:16,dispatch=capacity:1.25")
    assert all(type(v) is str for v in p.to_dict().values())
    assert p.to_dict()["matmul_kernel"] == "tiled:8" and p.to_dict()["dispatch"] == "capacity:1.25"
    assert json.loads(json.dumps(p.to_dict())) == p.to_dict()
    assert "kernel=tiled:8" in str(p) and "dispatch=capacity:1.25" in str(p)
    # the repr reads as the text (as before the types), so messages quoting a value are unchanged
    assert "matmul_kernel='tiled:8'" in repr(p) and "compute_dtype='bf16'" in repr(p)
    assert all(type(value) is str for diff in p.diff(NumericPolicy()) for value in diff)


def test_predicates_replace_string_checks():
    assert NumericPolicy.parse("param=bf16,compute=bf16,matmul=bf16").low_precision_accumulation
    assert not NumericPolicy.parse("matmul=BF16_BF16_F32").low_precision_accumulation
    assert not PRESETS["train-bf16"].low_precision_accumulation
    aligned = PRESETS["aligned-bf16"]
    assert aligned.batch_invariant_kernel and aligned.tree_reduction and aligned.ordered_cross_device
    assert not any((PRESETS["fp32"].batch_invariant_kernel, PRESETS["fp32"].tree_reduction,
                    PRESETS["fp32"].ordered_cross_device))
    assert aligned.rounds_below_f32 and not PRESETS["fp32"].rounds_below_f32
    assert not PRESETS["fp32-bf16pass"].rounds_below_f32  # a dot algorithm's name is not a low dtype
    assert NumericPolicy(index_scores_dtype="bf16").rounds_below_f32


def test_only_the_transformers_emulations_break_index_ties_as_torch():
    """`index_ties` stays lax.top_k's order (lower-slot, the default: every other preset's bits are unchanged)
    except in the hf-* presets, which emulate transformers on the CPU (torch-cpu)."""
    assert NumericPolicy().index_ties == "lower-slot"
    assert {name for name, policy in PRESETS.items() if policy.index_ties == "torch-cpu"} == {
        "hf-eager-bf16", "hf-grouped-bf16", "hf-fp32"}
    assert PRESETS["hf-fp32"].diff(PRESETS["fp32"]) == [("index_ties", "torch-cpu", "lower-slot")]
    p = NumericPolicy.parse("aligned-bf16,index_ties=torch-cpu")
    assert p.index_ties == "torch-cpu" and type(p.index_ties) is str and "index_ties=torch-cpu" in str(p)
    assert p.compact() == "aligned-bf16,index_ties=torch-cpu" and NumericPolicy.parse(str(p)) == p


@pytest.mark.parametrize("text, compact", [
    ("aligned-bf16", "aligned-bf16"),
    ("aligned-bf16,kernel=xla", "aligned-bf16,kernel=xla"),
    ("serve-bf16,matmul=bf16,combine_acc=bf16", "serve-bf16,matmul=bf16"),  # combine_acc is serve-bf16's already
    ("kernel=tiled:4", "fp32,kernel=tiled:4"),
])
def test_compact_is_the_nearest_preset_plus_overrides(text, compact):
    p = NumericPolicy.parse(text)
    assert p.compact() == compact and NumericPolicy.parse(p.compact()) == p


def test_every_preset_compacts_to_its_name():
    for name, policy in PRESETS.items():
        assert policy.compact() == name


def test_non_canonical_numbers_print_canonically():
    p = NumericPolicy.parse("kernel=tiled:08,dispatch=capacity:2.0")
    assert p.matmul_kernel == "tiled:8" and p.dispatch == "capacity:2"
    assert NumericPolicy.parse(str(p)) == p
