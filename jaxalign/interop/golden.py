"""The porting kit: golden files written by jaxalign, candidate files written by another stack, and the check
that compares them. Formats are plain JSON (see docs/porting.md); nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxalign.files import read_json, read_lines
from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.metrics.routing import routing_metrics
from jaxalign.model.scoring import forward
from jaxalign.model.transformer import Transformer, check_tokens
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.reduce import log_softmax

FORMAT = "jaxalign-golden-v1"
EQUIVALENCE_K3 = 1e-3  # the seed's threshold for calling two paths equivalent


def read_prompts(path: str) -> list[list[int]]:
    """Token sequences from a file: JSONL lines `{"tokens": [...]}` (or a bare JSON list), or plain lines of
    whitespace-separated integer ids."""
    sequences = []
    for number, line in enumerate(read_lines(path, "the prompts file"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            if line[0] in "[{":
                item = json.loads(line)
                tokens = item["tokens"] if isinstance(item, dict) else item
            else:
                tokens = [int(x) for x in line.split()]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: expected {{\"tokens\": [ids...]}} or space-separated ids "
                             f"({err})") from None
        if not isinstance(tokens, list) or len(tokens) < 2 or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{path}:{number}: a sequence needs at least 2 integer token ids")
        sequences.append(tokens)
    if not sequences:
        raise ValueError(f"{path}: no sequences")
    return sequences


def export_golden(model: Transformer, sequences: list[list[int]], policy: NumericPolicy, path: str, *,
                  top_n: int = 5) -> dict:
    """Score each sequence teacher-forced under `policy` and write the golden file. Returns its content."""
    from jaxalign.version import __version__
    cfg = model.config
    golden = {"format": FORMAT, "jaxalign_version": __version__, "policy": str(policy),
              "config_fingerprint": cfg.fingerprint(), "config": cfg.to_dict(), "top_n": top_n, "sequences": []}
    for i, seq in enumerate(sequences):
        tokens = check_tokens(np.asarray([seq]), cfg, name=f"sequence {i}")
        logits, record = forward(model, tokens, policy)
        lp = np.asarray(log_softmax(logits[0], policy))  # [S, V]
        top = np.argsort(-lp, axis=-1, kind="stable")[:, :top_n]
        golden["sequences"].append({
            "id": i, "tokens": [int(t) for t in seq],
            "logprobs": [None] + [float(lp[t - 1, seq[t]]) for t in range(1, len(seq))],
            "top_logprobs": [[[int(j), float(lp[t, j])] for j in top[t]] for t in range(len(seq))],
            "routed_experts": np.asarray(record.indices)[0].tolist(),
        })
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(golden, f)
    os.replace(tmp, path)
    return golden


def read_candidate(path: str) -> dict[int, dict]:
    """Candidate JSONL: one object per sequence with `id`, `tokens`, `logprobs` (entry t = log p(tokens[t] |
    tokens[:t]); entry 0 null) and optionally `routed_experts` [seq][moe_layers][k]."""
    out = {}
    for number, line in enumerate(read_lines(path, "the candidate file"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            key = int(item["id"])
            item["tokens"], item["logprobs"]  # noqa: B018  (presence check)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: expected a JSON object with id, tokens, logprobs ({err})") from None
        out[key] = item
    return out


def check_golden(golden_path: str, candidate_path: str, *, threshold: float = EQUIVALENCE_K3) -> dict:
    """Compare a candidate to a golden file: k3, max |dlogp|, route agreement, pass/fail at `threshold`."""
    golden = read_json(golden_path, "the golden file")
    if not isinstance(golden, dict) or golden.get("format") != FORMAT:
        found = golden.get("format") if isinstance(golden, dict) else type(golden).__name__
        raise ValueError(f"{golden_path}: format {found!r}; expected {FORMAT!r}")
    candidate = read_candidate(candidate_path)
    seqs = golden["sequences"]
    missing = [s["id"] for s in seqs if s["id"] not in candidate]
    if missing:
        raise ValueError(f"candidate has no line for sequence ids {missing[:10]}")
    width = max(len(s["tokens"]) for s in seqs)
    lg = np.zeros((len(seqs), width - 1))
    lc = np.zeros_like(lg)
    mask = np.zeros(lg.shape, bool)
    routes_g, routes_c = [], []
    for row, s in enumerate(seqs):
        c = candidate[s["id"]]
        if list(c["tokens"]) != s["tokens"]:
            raise ValueError(f"sequence {s['id']}: candidate tokens differ from the golden tokens")
        if len(c["logprobs"]) != len(s["tokens"]):
            raise ValueError(f"sequence {s['id']}: candidate has {len(c['logprobs'])} logprobs for "
                             f"{len(s['tokens'])} tokens (entry 0 is null)")
        n = len(s["tokens"]) - 1
        lg[row, :n] = s["logprobs"][1:]
        lc[row, :n] = [float(x) for x in c["logprobs"][1:]]
        mask[row, :n] = True
        if c.get("routed_experts") is not None:
            routes_g.append(np.asarray(s["routed_experts"])[:n])
            routes_c.append(np.asarray(c["routed_experts"])[:n])
    metrics = mismatch_metrics(lg, lc, mask)
    report = {"golden": golden_path, "candidate": candidate_path, "policy": golden["policy"],
              "threshold_k3": threshold, "k3_kl": metrics["k3_kl"], "kl": metrics["kl"],
              "max_abs_logp_diff": metrics["max_abs_logp_diff"],
              "mean_abs_logp_diff": metrics["mean_abs_logp_diff"], "n_tokens": metrics["n_tokens"],
              "passed": bool(metrics["k3_kl"] <= threshold)}
    if routes_g:
        a = np.concatenate(routes_g)[None]
        b = np.concatenate(routes_c)[None]
        if a.shape != b.shape:
            raise ValueError(f"candidate routed_experts shape {b.shape[1:]} differs from golden {a.shape[1:]}")
        r = routing_metrics(a, b)
        report["route_agreement"] = 1.0 - r["route_flip_rate"]
        report["route_flip_rate_per_layer"] = r["route_flip_rate_per_layer"]
    return report
