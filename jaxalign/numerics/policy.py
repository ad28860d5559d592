"""NumericPolicy: every numeric decision the model makes, as one frozen, hashable value.

A policy prints as a short string (`param=bf16,compute=bf16,...`) and parses back from it, so a policy can
travel on a command line, in a checkpoint's metadata or in a routing record. `NumericPolicy.parse` also
accepts a preset name, optionally followed by overrides: `"aligned-bf16,kernel=xla"`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

from jaxalign.numerics.policy_values import (Capacity, Chunked, DotAlgorithm, DType, Fp8Blocks, Fp8Tiles, Int4Groups,
                                             Mxfp4, Pallas, Tiled)

DTYPES = tuple(DType)


@dataclasses.dataclass(frozen=True)
class _Field:
    key: str  # short name used in the policy string
    allowed: str  # human-readable description of allowed values
    parse: Callable[[object], Any]  # a field value (text or typed) -> its typed value, or None when not allowed
    doc: str


def _one_of(*values: str) -> Callable[[object], str | None]:
    """Plain choices: the canonical `str` of a listed value."""
    return lambda v: values[values.index(v)] if isinstance(v, str) and v in values else None


def _typed(kind) -> Callable[[object], Any]:
    """A typed value: an instance passes through, text goes through `kind.parse`."""
    return lambda v: v if isinstance(v, kind) else kind.parse(v)


def _either(*parsers: Callable[[object], Any]) -> Callable[[object], Any]:
    def parse(value):
        for one in parsers:
            typed = one(value)
            if typed is not None:
                return typed
        return None
    return parse


def _logit_scale(value) -> float | None:
    """A float in (0, 4] (text or number), or None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if 0.0 < number <= 4.0 else None


def _iterations(value) -> int | None:
    """An int >= 1 (text of decimal digits, or an int that is not a bool), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 1 else None
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
        return number if number >= 1 else None
    return None


_DTYPE = _typed(DType)
_F32_ONLY = lambda v: DType.f32 if v == "f32" else None  # noqa: E731

FIELDS: dict[str, _Field] = {
    "param_dtype": _Field("param", "f32|bf16|f16", _DTYPE,
                          "dtype the weights are cast to before use (the engine casts once at load)"),
    "compute_dtype": _Field("compute", "f32|bf16|f16", _DTYPE,
                            "dtype of activations between ops"),
    "matmul_acc": _Field("matmul", "f32|bf16|f16|<lax.DotAlgorithmPreset name>",
                         _either(_DTYPE, _typed(DotAlgorithm)),
                         "matmul accumulation: f32 (preferred_element_type=f32), bf16/f16 (partial sums rounded "
                         "every 16 products of the contraction, emulating low-precision accumulators), all three with "
                         "precision=HIGHEST (full f32 products of f32 operands on every backend); or a "
                         "DotAlgorithmPreset passed to XLA as the products' algorithm"),
    "matmul_bwd": _Field("matmul_bwd", "same|f32|<lax.DotAlgorithmPreset name>",
                         _either(_one_of("same"), _F32_ONLY, _typed(DotAlgorithm)),
                         "precision of the gradient's products: same = the forward's; f32 = HIGHEST; or a "
                         "DotAlgorithmPreset"),
    "transcendental_accuracy": _Field("transcendental", "default|highest", _one_of("default", "highest"),
                                      "accuracy asked of exp/log in softmaxes and log-softmax: default = the "
                                      "backend's; highest = lax.AccuracyMode.HIGHEST"),
    "matmul_kernel": _Field("kernel", "xla|tiled:T|probed:T (T a positive int)|pallas:BMxBNxBK (each a power of "
                            "two >= 8)",
                            _either(_one_of("xla"), _typed(Tiled), _typed(Pallas)),
                            "xla = whatever XLA emits; tiled:T = fixed [T, K] row tiles (batch invariant); "
                            "probed:T = a plain product on rows padded to a bucket where a probe of this backend "
                            "proved it row-invariant for the shape, tiled:T elsewhere (numerics/invariance.py); "
                            "pallas:BMxBNxBK = the same semantics in Pallas kernels (fixed [BM, BN] output "
                            "blocks, the contraction in BK chunks in a fixed order, f32 accumulation; interpret "
                            "mode on the CPU, compiled on GPU/TPU; jaxalign/numerics/pallas_matmul.py)"),
    "reduction": _Field("reduce", "xla|tree", _one_of("xla", "tree"),
                        "sums in norms, softmaxes and attention: xla's reduce, or a fixed halving tree that is "
                        "invariant to batch shape and to zero padding"),
    "norm_dtype": _Field("norm", "f32|bf16|f16", _DTYPE, "dtype RMSNorm is computed in"),
    "rope_dtype": _Field("rope", "f32|bf16|f16", _DTYPE, "dtype of the RoPE rotation"),
    "router_logits_dtype": _Field("router", "f32|bf16|f16", _DTYPE,
                                  "dtype of the router linear layer (inputs, weights, output)"),
    "router_softmax_dtype": _Field("router_softmax", "f32|bf16|f16", _DTYPE,
                                   "dtype of the router softmax / sigmoid and top-k scores"),
    "combine_weight_dtype": _Field("gate", "f32|bf16|f16", _DTYPE,
                                   "dtype of the gate weights and of their product with the expert outputs"),
    "combine_acc_dtype": _Field("combine_acc", "f32|bf16|f16", _DTYPE,
                                "dtype the weighted expert outputs are multiplied and summed in"),
    "combine_order": _Field("combine", "slot|expert|dense", _one_of("slot", "expert", "dense"),
                            "slot = sum over the k slots in top-k order; expert = one expert at a time in id "
                            "order (transformers eager); dense = reduce over all experts with zeros (MaxText dense)"),
    "dispatch": _Field("dispatch", "dense|sorted|gather|bucketed|capacity:F (F a positive float)",
                       _either(_one_of("dense", "sorted", "gather", "bucketed"), _typed(Capacity)),
                       "dense = every expert sees every token; sorted = argsort + grouped matmul; gather = each "
                       "token's k expert weights gathered, batched vector-matrix products (decode engines); "
                       "bucketed = per-expert buffers sized (from a fixed ladder) to the busiest expert, nothing "
                       "dropped; capacity:F = per-expert buffers of F*tokens*k/experts rows, overflow dropped"),
    "attention": _Field("attn", "full|chunked:C (C a positive int)",
                        _either(_one_of("full"), _typed(Chunked)),
                        "full softmax over all keys, or online softmax over fixed chunks of C keys"),
    "attn_sink": _Field("sink", "seed|merge", _one_of("seed", "merge"),
                        "where an attention sink (a learned per-head logit that joins the softmax's max and sum but "
                        "brings no value; gpt-oss, models with the sink kinds only) enters the softmax: seed = it "
                        "starts the running max and sum (max = the sink, sum = 1) before any key, as flash kernels "
                        "with sinks do (in the full form: the max over the keys and the sink, the sink's term added to "
                        "the keys' sum, as transformers' eager concatenated column); merge = the keys' softmax runs "
                        "as without a sink and the sink is merged in afterwards, the output scaled by the keys' share "
                        "l / (l + exp(sink - m)) of the combined sum (how a kernel without sinks is corrected after "
                        "the fact; jaxalign/numerics/attention.py)"),
    "attn_scores_dtype": _Field("attn_scores", "f32|bf16|f16", _DTYPE,
                                "dtype the q.k scores are rounded to and scaled in (transformers' eager "
                                "attention: the model dtype)"),
    "attn_softmax_dtype": _Field("attn_softmax", "f32|bf16|f16", _DTYPE,
                                 "dtype of the attention softmax"),
    "kv_cache_dtype": _Field("kv", "f32|bf16|f16", _DTYPE,
                             "dtype keys and values are stored in before attention reads them"),
    "logits_dtype": _Field("logits", "f32|bf16|f16", _DTYPE, "dtype of the LM-head output"),
    "lora": _Field("lora", "merged|unmerged", _one_of("merged", "unmerged"),
                   "LoRA adapters folded into the weights (rounded to the param dtype) or applied as a separate "
                   "low-rank path"),
    "cross_device": _Field("xdev", "xla|ordered", _one_of("xla", "ordered"),
                           "sums over an axis split across devices: xla = the partitioner's partial sums and "
                           "all-reduce (order depends on the mesh); ordered = the axis is gathered first and summed "
                           "on one device in the single-device order (bitwise equal to one device for any mesh)"),
    "mla": _Field("mla", "expanded|absorbed", _one_of("expanded", "absorbed"),
                  "multi-head latent attention (MLA models only): expanded = keys and values up-projected per head "
                  "from the latent (trainers); absorbed = the key up-projection folded into the query, attention "
                  "over the latent itself, the value up-projection after it (serving engines)"),
    "index_scores_dtype": _Field("index", "f32|bf16|f16", _DTYPE,
                                 "dtype of the DSA indexer's q.k scores, head weights and weighted sum, from which "
                                 "its top-k picks the keys each query attends to (DSA models only)"),
    "index_ties": _Field("index_ties", "lower-slot|torch-cpu", _one_of("lower-slot", "torch-cpu"),
                         "which keys the DSA indexer's top-k keeps when scores tie exactly at its k-th value (relu "
                         "zeroes many scores): lower-slot = lax.top_k's order, the lower slot first (engine and "
                         "trainer alike, whatever their number of slots); torch-cpu = the keys torch.topk keeps on "
                         "the CPU (libstdc++'s introselect over the row of keys transformers holds after the call: "
                         "no positional rule, and dependent on that row's length; numerics/torch_topk.py)"),
    "weight_quant": _Field("wq", "none|e4m3:RxC (R, C positive ints)|mxfp4|int4:G (G a positive int)",
                           _either(_one_of("none"), _typed(Fp8Blocks), _typed(Mxfp4), _typed(Int4Groups)),
                           "quantised weights, quantised from their float32 masters at every weight sync (engine) "
                           "and inside the forward (trainer, straight-through gradient): none; e4m3:RxC = FP8 in "
                           "[R, C] blocks, one scale each, products per K block in float32, scaled, summed in block "
                           "order (jaxalign/numerics/fp8.py); mxfp4 = OCP MXFP4 (E2M1 elements, one E8M0 scale per "
                           "32 along K); int4:G = symmetric INT4, one scale per G along K (qscale: its format); the "
                           "4-bit formats multiply their dequantised values with the policy's own product, or with "
                           "act_quant's tiles (jaxalign/numerics/lowbit.py). Which weights: quant_scope; embedding, "
                           "LM head, router and MLA's kv_b stay unquantised"),
    "quant_scope": _Field("wq_scope", "all|experts", _one_of("all", "experts"),
                          "which weights weight_quant (and act_quant's activations) applies to: all = every linear "
                          "and routed-expert weight; experts = the routed experts only (how gpt-oss, DeepSeek-V4 and "
                          "Kimi K3 serve 4-bit experts)"),
    "act_quant": _Field("aq", "none|e4m3:B (B a positive int)", _either(_one_of("none"), _typed(Fp8Tiles)),
                        "FP8 activations: none, or the input of every quantised-weight product rounded to "
                        "float8_e4m3fn in 1xB tiles along the contraction, one scale per tile from its own amax"),
    "quant_scale": _Field("qscale", "f32|e8m0", _one_of("f32", "e8m0"),
                          "FP8 and INT4 scale format: f32 = amax / 448 (INT4: amax / 7); e8m0 = its power-of-two "
                          "ceiling (exact to apply); MXFP4's scales are E8M0 by its spec whatever this says"),
    "kv_quant": _Field("kvq", "none|e4m3|e5m2", _one_of("none", "e4m3", "e5m2"),
                       "FP8 KV cache: none; e4m3 = keys and values rounded to float8_e4m3fn with one scale per "
                       "token and kv head (MLA: per token over the latent cache row), read back as (value * scale) "
                       "in kv_cache_dtype; e5m2 = cast to float8_e5m2 without a scale, as vLLM's fp8_e5m2 cache "
                       "does (2 mantissa bits; saturated to +-57344)"),
    "logit_scale": _Field("logit_scale", "a float in (0, 4]", _logit_scale,
                          "SYNTHETIC, not a number format: the LM head's logits multiplied by this factor (1 = off), "
                          "i.e. sampling at another temperature -- a controllable engine-side gap for studying doses "
                          "that FP8 does not reach on a small model (jaxalign.rl.study); never part of a preset"),
    "sinkhorn_iters": _Field("sinkhorn", "model|N (N an int >= 1)", _either(_one_of("model"), _iterations),
                             "mHC models only (DeepSeek-V4): how many Sinkhorn iterations normalise the hyper-"
                             "connections' stream-mixing matrix (columns, then N - 1 rounds of rows then columns): "
                             "model = the model config's hc_iters (hc_sinkhorn_iters of the checkpoint); N = that many "
                             "whatever the config says, as an engine running fewer iterations than the checkpoint's "
                             "(jaxalign/numerics/sinkhorn.py)"),
    "sinkhorn_dtype": _Field("sinkhorn_dtype", "f32|bf16|f16", _DTYPE,
                             "mHC models only (DeepSeek-V4): dtype the Sinkhorn iterations compute in (the mixing "
                             "matrix rounded to it, its row and column sums and divisions in it)"),
    "delta_rule": _Field("delta", "recurrent|chunked:C (C a positive int)",
                         _either(_one_of("recurrent"), _typed(Chunked)),
                         "gated DeltaNet layers only: recurrent = one token at a time (transformers' "
                         "torch_recurrent_gated_delta_rule, vLLM's fused recurrent decode kernel); chunked:C = chunks "
                         "of C tokens through the UT transform (torch_chunk_gated_delta_rule, FLA's chunk kernel: "
                         "what trainers run); the same math, rounded differently (jaxalign/numerics/delta_rule.py)"),
    "delta_state_dtype": _Field("delta_state", "f32|bf16|f16", _DTYPE,
                                "dtype the gated DeltaNet recurrent state [B, H, Dk, Dv] is stored in between tokens "
                                "(recurrent) or chunks (chunked), in the engine's state and the trainer's forward alike"),
    "conv_state_dtype": _Field("conv_state", "f32|bf16|f16", _DTYPE,
                               "dtype of the gated DeltaNet short convolution's inputs as its state stores them (the "
                               "last K-1 inputs); the trainer's forward rounds them the same way"),
}
_BY_KEY = {f.key: name for name, f in FIELDS.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumericPolicy:
    """All numeric choices of one compiled program. Frozen and hashable: pass it as a static jit argument.

    Fields hold typed values (`jaxalign.numerics.policy_values`: `DType`, `Tiled(8)`, `Chunked(16)`,
    `Capacity(1.25)`, `Pallas(8, 16, 16)`, `DotAlgorithm(name)`; plain choices stay `str`), parsed once here:
    `NumericPolicy(...)` and `replace(...)` accept either those values or their text (`matmul_kernel="tiled:8"`).
    """

    param_dtype: DType = DType.f32
    compute_dtype: DType = DType.f32
    matmul_acc: DType | DotAlgorithm = DType.f32
    matmul_kernel: Literal["xla"] | Tiled | Pallas = "xla"
    matmul_bwd: Literal["same"] | DType | DotAlgorithm = "same"
    transcendental_accuracy: Literal["default", "highest"] = "default"
    reduction: Literal["xla", "tree"] = "xla"
    norm_dtype: DType = DType.f32
    rope_dtype: DType = DType.f32
    router_logits_dtype: DType = DType.f32
    router_softmax_dtype: DType = DType.f32
    combine_weight_dtype: DType = DType.f32
    combine_acc_dtype: DType = DType.f32
    combine_order: Literal["slot", "expert", "dense"] = "slot"
    dispatch: Literal["dense", "sorted", "gather", "bucketed"] | Capacity = "dense"
    attention: Literal["full"] | Chunked = "full"
    attn_sink: Literal["seed", "merge"] = "seed"
    attn_scores_dtype: DType = DType.f32
    attn_softmax_dtype: DType = DType.f32
    kv_cache_dtype: DType = DType.f32
    logits_dtype: DType = DType.f32
    lora: Literal["merged", "unmerged"] = "merged"
    cross_device: Literal["xla", "ordered"] = "xla"
    mla: Literal["expanded", "absorbed"] = "expanded"
    index_scores_dtype: DType = DType.f32
    index_ties: Literal["lower-slot", "torch-cpu"] = "lower-slot"
    weight_quant: Literal["none"] | Fp8Blocks | Mxfp4 | Int4Groups = "none"
    quant_scope: Literal["all", "experts"] = "all"
    act_quant: Literal["none"] | Fp8Tiles = "none"
    quant_scale: Literal["f32", "e8m0"] = "f32"
    kv_quant: Literal["none", "e4m3", "e5m2"] = "none"
    logit_scale: float = 1.0
    sinkhorn_iters: Literal["model"] | int = "model"
    sinkhorn_dtype: DType = DType.f32
    delta_rule: Literal["recurrent"] | Chunked = Chunked(64)
    delta_state_dtype: DType = DType.f32
    conv_state_dtype: DType = DType.f32

    def __post_init__(self) -> None:
        for name, spec in FIELDS.items():
            value = getattr(self, name)
            typed = spec.parse(value)
            if typed is None:
                raise ValueError(f"NumericPolicy.{name} ({spec.key}) = {value!r} is not allowed; "
                                 f"allowed: {spec.allowed}")
            object.__setattr__(self, name, typed)  # frozen: the one place a field is set after construction
        if self.low_precision_accumulation and self.matmul_acc != self.compute_dtype:
            raise ValueError(f"NumericPolicy.matmul_acc = {self.matmul_acc!r} accumulates below the compute dtype "
                             f"{self.compute_dtype!r}; allowed: f32, a DotAlgorithmPreset, or the compute dtype")
        if self.pallas_blocks is not None and self.matmul_acc != DType.f32:
            raise ValueError(f"NumericPolicy.matmul_acc = {self.matmul_acc!r} with matmul_kernel = "
                             f"{self.matmul_kernel!r}: the Pallas kernels accumulate in float32; allowed: f32")
        if self.dispatch == "gather" and (self.batch_invariant_kernel or self.low_precision_accumulation):
            raise ValueError("NumericPolicy.dispatch = 'gather' uses batched vector-matrix products with float32 "
                             "accumulation; it needs matmul_kernel 'xla' and matmul_acc f32 (or a DotAlgorithmPreset)")
        if self.quantizes_products and (self.dispatch == "gather" or self.lora == "unmerged"
                                        or self.low_precision_accumulation):
            raise ValueError(f"NumericPolicy.weight_quant = {self.weight_quant!r} / act_quant = {self.act_quant!r}: "
                             f"the quantised products accumulate each block in float32 and run the dense, sorted, "
                             f"bucketed and capacity dispatches on merged weights; allowed with them: dispatch "
                             f"other than 'gather', lora 'merged', matmul_acc f32 or a DotAlgorithmPreset")

    # --- predicates and derived values the numerics modules read ------------------------------------------
    @property
    def low_precision_accumulation(self) -> bool:
        """matmul_acc is bf16 or f16: partial sums rounded every ACC_CHUNK products (numerics/matmul.py)."""
        return isinstance(self.matmul_acc, DType) and self.matmul_acc.is_low_precision

    @property
    def batch_invariant_kernel(self) -> bool:
        """The matmul kernel is `tiled:T` or `pallas:...` (fixed row tiles), not XLA's own."""
        return self.matmul_kernel != "xla"

    @property
    def tree_reduction(self) -> bool:
        """Sums run as a fixed halving tree (`reduce=tree`), invariant to batch shape and zero padding."""
        return self.reduction == "tree"

    @property
    def ordered_cross_device(self) -> bool:
        """Sums over a split axis are gathered and summed in the single-device order (`xdev=ordered`)."""
        return self.cross_device == "ordered"

    @property
    def rounds_below_f32(self) -> bool:
        """Some field asks for bf16 or f16 (a dtype or a low-precision accumulator)."""
        return any(isinstance(v, DType) and v.is_low_precision for v in (getattr(self, n) for n in FIELDS))

    @property
    def quantizes_products(self) -> bool:
        """Some quantised-product field is set (`weight_quant` or `act_quant`): expert products (and, under
        `quant_scope=all`, linear ones) run quantised (numerics/fp8.py, numerics/lowbit.py)."""
        return self.weight_quant != "none" or self.act_quant != "none"

    @property
    def lowbit_weights(self) -> bool:
        """`weight_quant` is a 4-bit format (`mxfp4`, `int4:G`; numerics/lowbit.py)."""
        return isinstance(self.weight_quant, (Mxfp4, Int4Groups))

    @property
    def quantizes_linears(self) -> bool:
        """Linear layers (not only routed experts) run quantised products: some product field is set and
        `quant_scope` is `all`."""
        return self.quantizes_products and self.quant_scope == "all"

    @property
    def weight_blocks(self) -> tuple[int, int] | None:
        """(R, C) of `weight_quant=e4m3:RxC`, or None."""
        return (self.weight_quant.rows, self.weight_quant.cols) if isinstance(self.weight_quant, Fp8Blocks) else None

    @property
    def act_tile(self) -> int | None:
        """B of `act_quant=e4m3:B`, or None."""
        return self.act_quant.size if isinstance(self.act_quant, Fp8Tiles) else None

    @property
    def tile_rows(self) -> int | None:
        """Row-tile size of the tiled matmul kernel (`tiled:T`, or `probed:T`'s fallback), or None for the xla
        kernel."""
        return self.matmul_kernel.rows if isinstance(self.matmul_kernel, Tiled) else None

    @property
    def probed_kernel(self) -> bool:
        """`probed:T`: plain products where a probe proved them row-invariant (numerics/invariance.py)."""
        return isinstance(self.matmul_kernel, Tiled) and self.matmul_kernel.probed

    @property
    def pallas_blocks(self) -> tuple[int, int, int] | None:
        """(BM, BN, BK) block shape of the Pallas kernels, or None when the kernel is not `pallas:...`."""
        return self.matmul_kernel.blocks if isinstance(self.matmul_kernel, Pallas) else None

    @property
    def attention_chunk(self) -> int | None:
        """KV chunk size of chunked attention, or None for full attention."""
        return self.attention.size if isinstance(self.attention, Chunked) else None

    @property
    def delta_chunk(self) -> int | None:
        """Chunk size of the chunked delta rule, or None for the recurrent form."""
        return self.delta_rule.size if isinstance(self.delta_rule, Chunked) else None

    @property
    def capacity_factor(self) -> float | None:
        """Capacity factor of token-dropping dispatch, or None."""
        return self.dispatch.factor if isinstance(self.dispatch, Capacity) else None

    # --- string form -------------------------------------------------------------------------------------
    def __str__(self) -> str:
        return ",".join(f"{spec.key}={getattr(self, name)}" for name, spec in FIELDS.items())

    def compact(self) -> str:
        """The shortest string that parses back to this policy: the nearest preset's name, then the fields that
        differ from it (`aligned-bf16` or `aligned-bf16,kernel=xla`); what configs and arms record."""
        def text(name: str, base: "NumericPolicy") -> str:
            overrides = [f"{FIELDS[f].key}={mine}" for f, mine, _ in self.diff(base)]
            return ",".join([name, *overrides])
        return min((text(name, base) for name, base in PRESETS.items()), key=lambda t: t.count(","))

    @classmethod
    def parse(cls, text: str) -> "NumericPolicy":
        """Parse `key=value,...`, optionally led by a preset name, e.g. `aligned-bf16,kernel=xla`.

        Unnamed fields take the preset's value (or the `fp32` defaults when no preset leads).
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"policy string must be a non-empty string, got {text!r}; "
                             f"use a preset ({', '.join(PRESETS)}) or key=value pairs")
        parts = [p.strip() for p in text.split(",") if p.strip()]
        base: dict[str, Any] = {}
        if "=" not in parts[0]:
            preset = cls.preset(parts[0])
            base = {name: getattr(preset, name) for name in FIELDS}
            parts = parts[1:]
        seen = set()
        for part in parts:
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"policy item {part!r} is not key=value (only the first item may be a preset name)")
            name = _BY_KEY.get(key, key if key in FIELDS else None)
            if name is None:
                raise ValueError(f"unknown policy key {key!r}; allowed keys: {', '.join(f.key for f in FIELDS.values())}")
            if name in seen:
                raise ValueError(f"policy key {key!r} given twice in {text!r}")
            seen.add(name)
            base[name] = value.strip()
        return cls(**base)

    @classmethod
    def coerce(cls, value: "NumericPolicy | str", *, label: str = "policy") -> "NumericPolicy":
        """A policy as it is: text is parsed (errors name `label`); anything else is refused clearly."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls.parse(value)
            except ValueError as err:
                raise ValueError(f"{label}: {err}") from None
        raise ValueError(f"{label} must be a NumericPolicy or a policy string, got {type(value).__name__}")

    @classmethod
    def preset(cls, name: str) -> "NumericPolicy":
        """A named preset; see `PRESETS` and `docs/policies.md`."""
        if name not in PRESETS:
            raise ValueError(f"unknown policy preset {name!r}; allowed: {', '.join(PRESETS)}")
        return PRESETS[name]

    def replace(self, **changes: Any) -> "NumericPolicy":
        """A copy with some fields changed (validated; values as text or typed)."""
        return dataclasses.replace(self, **changes)

    def diff(self, other: "NumericPolicy") -> list[tuple[str, str, str]]:
        """Fields where the two policies differ, as (field, self's value, other's value), values as text."""
        return [(name, str(getattr(self, name)), str(getattr(other, name)))
                for name in FIELDS if getattr(self, name) != getattr(other, name)]

    def to_dict(self) -> dict[str, str]:
        """Field name -> value as text (what JSON, routing records and golden files store)."""
        return {name: str(getattr(self, name)) for name in FIELDS}


def _bf16_compute(**overrides: str) -> NumericPolicy:
    # the DeltaNet conv state holds bf16 inputs (vLLM's and SGLang's); its recurrent state stays f32
    return NumericPolicy(param_dtype="bf16", compute_dtype="bf16", kv_cache_dtype="bf16", conv_state_dtype="bf16",
                         **overrides)


PRESETS: dict[str, NumericPolicy] = {
    # The reference: float32 everywhere, XLA's kernels.
    "fp32": NumericPolicy(),
    # A typical mixed-precision trainer: bf16 matmuls over f32 masters, f32 norms/router/softmax/logits,
    # sorted (grouped-matmul) expert dispatch, f32 combine.
    "train-bf16": _bf16_compute(dispatch="sorted"),
    # A fast serving engine: bf16 router and gate weights, bf16 combine, flash-decoding style chunked attention,
    # bf16 logits, absorbed MLA.
    "serve-bf16": _bf16_compute(norm_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                                combine_acc_dtype="bf16", attention="chunked:16", logits_dtype="bf16",
                                mla="absorbed", delta_rule="recurrent"),
    # The fast bf16 serving baseline the cost of alignment is measured against (benchmarks/alignment_cost.py):
    # serve-bf16 with only the selected experts' rows multiplied (bucketed dispatch, nothing dropped), as
    # serving engines' fused MoE kernels do; attention stays flash-decoding style (chunked).
    "serve-fast-bf16": _bf16_compute(norm_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                                     combine_acc_dtype="bf16", attention="chunked:16", logits_dtype="bf16",
                                     dispatch="bucketed", mla="absorbed", delta_rule="recurrent"),
    # The fast bf16 training baseline: train-bf16 with a grouped GEMM that runs only the selected experts on
    # this backend (bucketed dispatch; train-bf16's lax.ragged_dot runs densely over all experts on XLA:CPU).
    "train-fast-bf16": _bf16_compute(dispatch="bucketed"),
    # Used on both sides: batch-invariant kernels (fixed row tiles, halving-tree reductions) so engine and
    # trainer logprobs are bitwise identical, while matmuls stay bf16. RoPE and gate weights are bf16 so every
    # product that feeds an add is exact in f32: XLA:CPU contracts a*b+c into an FMA or not depending on
    # fusion, and only exact products make both roundings agree (docs/policies.md).
    # Cross-device sums are ordered, so the bits do not depend on the mesh either (docs/scaling.md).
    # Sorted dispatch runs only the selected experts; under the tiled kernel its bits equal the dense dispatch's.
    # Gated DeltaNet layers run the recurrent delta rule on both sides (the engine's decode form; the trainer
    # scans the same per-token steps), so its state has the same bits wherever a sequence is cut.
    "aligned-bf16": _bf16_compute(matmul_kernel="tiled:8", reduction="tree", rope_dtype="bf16",
                                  combine_weight_dtype="bf16", cross_device="ordered", dispatch="sorted",
                                  delta_rule="recurrent"),
    # FP8 rollouts as verl and slime run them (DeepSeek-style W8A8): the serve-bf16 engine with every linear and
    # expert weight in e4m3 [16, 16] blocks (128x128 on real models, scaled to the tiny ones' 32-64 wide
    # matrices), activations in 1x16 e4m3 tiles, f32 scales, and an e4m3 KV cache; trained against a bf16
    # trainer (train-bf16), which never sees the quantisation.
    "serve-fp8": _bf16_compute(norm_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                               combine_acc_dtype="bf16", attention="chunked:16", logits_dtype="bf16",
                               mla="absorbed", weight_quant="e4m3:16x16", act_quant="e4m3:16", kv_quant="e4m3",
                               delta_rule="recurrent"),
    # DeepSeek-V4's aligned recipe (verl PR #7688): aligned-bf16 plus the same W8A8 products in the trainer's
    # forward, quantised from its float32 masters; the gradient reaches the masters straight through (as if
    # quantisation were the identity: the backward of aligned-bf16's bf16 products). Engine == trainer bitwise.
    "aligned-fp8": _bf16_compute(matmul_kernel="tiled:8", reduction="tree", rope_dtype="bf16",
                                 combine_weight_dtype="bf16", cross_device="ordered", dispatch="sorted",
                                 weight_quant="e4m3:16x16", act_quant="e4m3:16", delta_rule="recurrent"),
    # 4-bit rollouts as gpt-oss, DeepSeek-V4 and Kimi K3 are served (W4A16): the serve-bf16 engine with its routed
    # experts in MXFP4 (E2M1 elements, one E8M0 scale per 32 along the contraction), dequantised into its bf16
    # products; trained against a bf16 trainer (train-bf16), which never sees the quantisation.
    "serve-mxfp4": _bf16_compute(norm_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                                 combine_acc_dtype="bf16", attention="chunked:16", logits_dtype="bf16",
                                 mla="absorbed", weight_quant="mxfp4", quant_scope="experts", delta_rule="recurrent"),
    # The aligned answer to 4-bit rollouts (Kimi K2-Thinking's quantisation-aware training, in MXFP4): aligned-bf16
    # with the routed experts in MXFP4 on both sides -- the engine re-quantises at every sync, the trainer's
    # forward quantises its float32 masters with the same functions, the gradient straight through. Engine ==
    # trainer bitwise.
    "aligned-mxfp4": _bf16_compute(matmul_kernel="tiled:8", reduction="tree", rope_dtype="bf16",
                                   combine_weight_dtype="bf16", cross_device="ordered", dispatch="sorted",
                                   weight_quant="mxfp4", quant_scope="experts", delta_rule="recurrent"),
    # What an accelerator does with float32 products left at DEFAULT precision, made explicit for study: one bf16
    # pass (a TPU's DEFAULT), three bf16 passes (a TPU's HIGH), TF32 (an Ampere/Hopper GPU's DEFAULT). XLA:CPU
    # ignores the algorithm (same numbers as fp32) and JAX refuses TF32 on the CPU (docs/policies.md).
    "fp32-bf16pass": NumericPolicy(matmul_acc="BF16_BF16_F32"),
    "fp32-bf16x3": NumericPolicy(matmul_acc="BF16_BF16_F32_X3"),
    "fp32-tf32": NumericPolicy(matmul_acc="TF32_TF32_F32"),
    # Both sides in float16 (Qi et al. 2025); f32 norms, router, softmax and logits.
    "fp16": NumericPolicy(param_dtype="f16", compute_dtype="f16", kv_cache_dtype="f16"),
    # transformers' eager attention and expert loop: RoPE rotation and q.k scores in bf16, router linear in bf16, weights cast back to bf16, one expert at a time,
    # index_add_ in bf16; the DSA indexer's exact ties kept as torch.topk keeps them on the CPU.
    "hf-eager-bf16": _bf16_compute(rope_dtype="bf16", attn_scores_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                                   combine_acc_dtype="bf16", combine_order="expert", logits_dtype="bf16",
                                   index_ties="torch-cpu"),
    # transformers' grouped_mm path: same router and bf16 products, summed over the top-k slots in float32 and
    # cast once.
    "hf-grouped-bf16": _bf16_compute(rope_dtype="bf16", attn_scores_dtype="bf16", router_logits_dtype="bf16", combine_weight_dtype="bf16",
                                     combine_acc_dtype="f32", combine_order="slot", logits_dtype="bf16",
                                     index_ties="torch-cpu"),
    # transformers' float32 forward on the CPU: fp32, with the DSA indexer's exact ties kept as torch.topk keeps
    # them (relu zeroes many index scores, so ties at the top-k boundary are common; lax.top_k keeps others).
    "hf-fp32": NumericPolicy(index_ties="torch-cpu"),
}
